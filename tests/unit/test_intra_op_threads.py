"""A CPU engine's intra-op threads (torch_engine/threads.py): one thread while iterations are
too short to split, all of them once they grow; decided per window, by the median."""

from services.task_executor.engines.torch_engine.threads import SERIAL_S, WINDOW, IntraOpThreads


def feed(t: IntraOpThreads, seconds: float, n: int = WINDOW) -> list[int | None]:
    return [t.took(seconds) for _ in range(n)]


def test_short_iterations_move_to_one_thread_at_the_end_of_a_window():
    t = IntraOpThreads(2)
    changes = feed(t, SERIAL_S / 4)
    assert changes[:-1] == [None] * (WINDOW - 1) and changes[-1] == 1 and t.now == 1


def test_long_iterations_never_leave_all_threads():
    t = IntraOpThreads(4)
    assert feed(t, SERIAL_S / 2, 10 * WINDOW) == [None] * (10 * WINDOW)  # x4 > SERIAL_S
    assert t.now == 4


def test_growing_batches_go_back_to_all_threads():
    t = IntraOpThreads(2)
    feed(t, SERIAL_S / 4)
    assert feed(t, 2 * SERIAL_S)[-1] == 2 and t.now == 2


def test_a_few_stalls_do_not_decide():
    t = IntraOpThreads(2)
    times = [SERIAL_S / 4] * (WINDOW - 5) + [20 * SERIAL_S] * 5
    assert [t.took(s) for s in times][-1] == 1


def test_one_thread_in_all_has_nothing_to_choose():
    t = IntraOpThreads(1)
    assert feed(t, SERIAL_S / 10) == [None] * WINDOW and t.now == 1
