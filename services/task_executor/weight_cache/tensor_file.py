"""One engine tensor in a file of the host cache: written once, then mapped by every TE that
uses it, without a copy.

A file is a 4 KiB header (magic, then JSON: dtype, shape, layout, oneDNN's descriptor of a
packed weight, byte count) and the tensor's bytes from offset 4096, so the data starts on a
page. A plain tensor maps as a strided CPU tensor over the file's pages. A weight packed for
oneDNN (``linear.pack``: an opaque ``mkldnn`` tensor) is stored as its raw blocked bytes and
its serialized memory descriptor, and maps back as an ``mkldnn`` tensor over the file's pages
through torch's stable C shim (``aoti_torch_create_tensor_from_blob_v2``, the call AOTInductor
makes for its packed constants): a cache hit repacks nothing.

Mappings are private (copy on write): a TE that wrote into a weight by mistake would change
its own copy, never the file other TEs map. On tmpfs (``/dev/shm``) the pages are the file's
own, shared by every mapping; tmpfs gives them 4 KiB pages (its huge pages are off unless the
host enables them), which costs a decode step 2-3% against weights on transparent huge pages
(2-core Sapphire Rapids host: 47.0 vs 45.8 ms for Qwen2-0.5B's matrices at 1 token).
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.task_executor.dtypes import DTYPES, dtype_name

HEADER_BYTES = 4096
MAGIC = b"meshserve-tensor-1\n"


class TensorFileError(ValueError):
    """Not a tensor file of this format, or one this torch cannot map."""


def nbytes(t: torch.Tensor) -> int:
    if t.is_mkldnn:
        return int(torch.ops.mkldnn._nbytes(t))
    return t.numel() * t.element_size()


WRITE_SLICE = 32 << 20  # bytes written between two calls of ``write``'s ``pace``


def write(path: Path, t: torch.Tensor, pace: Callable[[], object] | None = None) -> int:
    """``t`` (a CPU tensor, plain or oneDNN-packed) into a new file at ``path`` (which must
    not exist: the caller writes a temporary name and renames). Returns the data bytes.
    ``pace``: called before each ``WRITE_SLICE`` bytes, and may block (a store after a load
    waits there while the engine has requests: ``CacheSession.finish``)."""
    name = dtype_name(t.dtype)
    if name not in DTYPES or t.device.type != "cpu":
        raise TensorFileError(f"cannot store a {t.dtype} tensor on {t.device}")
    meta: dict[str, Any] = {"dtype": name, "shape": list(t.shape)}
    if t.is_mkldnn:
        n = nbytes(t)
        md = torch.ops.mkldnn._get_mkldnn_serialized_md(t)
        meta |= {"layout": "mkldnn", "md": bytes(md.tolist()).hex(), "nbytes": n}
        data: Any = (ctypes.c_char * n).from_address(torch.ops.mkldnn.data_ptr(t))
    else:
        flat = t.detach().contiguous().view(-1)
        n = flat.numel() * flat.element_size()
        meta |= {"layout": "strided", "nbytes": n}
        data = flat.view(torch.uint8).numpy().data
    header = MAGIC + json.dumps(meta).encode()
    if len(header) > HEADER_BYTES:
        raise TensorFileError("tensor header too large")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, header.ljust(HEADER_BYTES, b"\0"))
        view = memoryview(data).cast("B")
        done = 0
        step = WRITE_SLICE if pace is not None else 1 << 30
        while done < n:
            if pace is not None:
                pace()
            done += os.write(fd, view[done : done + step])
    finally:
        os.close(fd)
    return n


def read_meta(fd: int) -> dict[str, Any]:
    return _parse_meta(os.pread(fd, HEADER_BYTES, 0))


def _parse_meta(head: bytes) -> dict[str, Any]:
    if not head.startswith(MAGIC):
        raise TensorFileError("not a meshserve tensor file")
    meta: dict[str, Any] = json.loads(head[len(MAGIC) :].rstrip(b"\0"))
    return meta


def map_tensor(fd: int) -> tuple[torch.Tensor, mmap.mmap]:
    """The tensor stored in the open file ``fd``, over a private mapping of its pages; the
    mapping must outlive the tensor (the caller keeps it)."""
    n = int(read_meta(fd)["nbytes"])
    if os.fstat(fd).st_size < HEADER_BYTES + n:
        raise TensorFileError("tensor file is truncated")
    mm = mmap.mmap(fd, HEADER_BYTES + n, access=mmap.ACCESS_COPY)
    return from_image(torch.frombuffer(mm, dtype=torch.uint8)), mm


def from_image(image: torch.Tensor) -> torch.Tensor:
    """The tensor in ``image``, a uint8 CPU tensor holding a whole tensor file (a file's
    mapping, or one received over the network), without a copy; ``image`` lives as long as
    the tensor does."""
    meta = _parse_meta(image[:HEADER_BYTES].numpy().tobytes())
    dtype = DTYPES[meta["dtype"]]
    shape = [int(s) for s in meta["shape"]]
    n = int(meta["nbytes"])
    if image.numel() < HEADER_BYTES + n:
        raise TensorFileError("tensor image is truncated")
    if meta["layout"] == "strided":
        return image[HEADER_BYTES : HEADER_BYTES + n].view(dtype).view(shape)
    if meta["layout"] == "mkldnn":
        addr = image.data_ptr() + HEADER_BYTES
        t = _mkldnn_from_blob(addr, shape, dtype, bytes.fromhex(meta["md"]))
        weakref.finalize(t, _keep, image)
        return t
    raise TensorFileError(f"unknown layout {meta['layout']!r}")


def _keep(*_: object) -> None:
    """A finalizer's no-op: its arguments live until the object it watches dies."""


@functools.cache
def _shim() -> Any:
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    for name in ("aoti_torch_layout__mkldnn", "aoti_torch_device_type_cpu"):
        getattr(lib, name).restype = ctypes.c_int32
    for name in ("bfloat16", "float32", "float16"):
        getattr(lib, f"aoti_torch_dtype_{name}").restype = ctypes.c_int32
    fn = lib.aoti_torch_create_tensor_from_blob_v2
    fn.restype = ctypes.c_int32
    i64p = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, i64p, i64p, ctypes.c_int64, ctypes.c_int32,
        ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
        ctypes.POINTER(ctypes.c_uint8), ctypes.c_int64,
    ]  # fmt: skip
    lib.aoti_torch_delete_tensor_object.argtypes = [ctypes.c_void_p]
    lib.aoti_torch_delete_tensor_object.restype = ctypes.c_int32
    capsule = ctypes.pythonapi.PyCapsule_New
    capsule.restype = ctypes.py_object
    capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return lib, capsule


def _mkldnn_from_blob(addr: int, shape: list[int], dtype: torch.dtype, md: bytes) -> torch.Tensor:
    lib, capsule = _shim()
    sizes = (ctypes.c_int64 * len(shape))(*shape)
    strides = (ctypes.c_int64 * len(shape))(*_contiguous_strides(shape))
    handle = ctypes.c_void_p()
    name = dtype_name(dtype)
    rc = lib.aoti_torch_create_tensor_from_blob_v2(
        addr, len(shape), sizes, strides, 0, getattr(lib, f"aoti_torch_dtype_{name}")(),
        lib.aoti_torch_device_type_cpu(), 0, ctypes.byref(handle),
        lib.aoti_torch_layout__mkldnn(), (ctypes.c_uint8 * len(md)).from_buffer_copy(md), len(md),
    )  # fmt: skip
    if rc != 0 or not handle.value:
        raise TensorFileError("torch could not map a packed weight (its C shim refused it)")
    t: torch.Tensor = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(
        capsule(handle.value, None, None)
    )
    # The Python tensor holds its own reference (torch 2.13 copies the handle's tensor):
    # the handle's goes, or the tensor would never be freed nor its file unlocked.
    lib.aoti_torch_delete_tensor_object(handle)
    return t


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return strides[::-1]
