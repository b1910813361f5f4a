"""The decode-length predictor (``services/job_executor/output_length.py``)."""

from __future__ import annotations

from services.job_executor.output_length import OutputPredictor, bucket_of, prompt_class


def test_buckets_and_classes() -> None:
    assert [bucket_of(n) for n in (1, 128, 129, 256, 257)] == [0, 0, 1, 1, 2]
    assert [prompt_class(n) for n in (1, 2, 3, 4, 4095, 4096)] == [0, 1, 1, 2, 11, 12]


def test_learns_per_prompt_class_and_falls_back_to_the_model() -> None:
    p = OutputPredictor()
    assert p.predict("m", 100, 500) == 500  # nothing learned: the request's own bound
    for _ in range(5):
        p.learn("m", 4000, 40)  # long prompts, short answers
        p.learn("m", 50, 600)  # short prompts, long answers
    assert p.predict_bucket("m", 3000) == 0 and p.predict("m", 3000, 1000) == 128
    assert p.predict_bucket("m", 40) == 4 and p.predict("m", 40, 1000) == 640
    assert p.predict("m", 40, 300) == 300  # never past max_tokens
    assert p.predict_bucket("m", 300) in (0, 4)  # an unseen class: the model's mode
    assert p.predict_bucket("other", 300) is None


def test_forgets_an_old_workload() -> None:
    p = OutputPredictor(decay=0.99)
    for _ in range(200):
        p.learn("m", 1000, 50)
    for _ in range(100):
        p.learn("m", 1000, 900)
    assert p.predict_bucket("m", 1000) == bucket_of(900)
