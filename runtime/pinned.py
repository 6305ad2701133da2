"""Pinned host memory of exactly the size asked for.

Why: torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two and
keeps freed blocks for reuse, so the cold experts that ``--vram 14GiB`` leaves a Qwen3.6-35B-A3B
model took nearly twice their size in locked RAM (PyTorch, vLLM and SGLang users report the same
rounding).
Anonymous pages from ``mmap``, page-locked with ``cudaHostRegister``, are locked at their size
and unlocked once the last tensor over them has gone (``release``). torch sees them as pinned (``is_pinned``:
asynchronous copies), and, registered as mapped, the GPU addresses them at the same pointer, so
the kernels read them over PCIe as they read torch's pinned memory.
"""
from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch

_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
# Pages whose last tensor went, still registered: ``release`` gives them back.
_released: list[tuple[int, mmap.mmap]] = []
# Held while a thread of its own registers pages (``runtime.host_pool``'s reserve) or waits on the
# device (``runtime.conversation_cache``'s writer), and while a CUDA graph is captured
# (``runtime.graph.run_and_capture``): a capture forbids such calls in any thread.
REGISTERING = threading.Lock()


def pinned_empty(nbytes: int, pin: bool = True, tidy: bool = True) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` (zeroed), page-locked when ``pin`` (and CUDA is there).
    Where the driver refuses to register the pages, torch's own pinned allocator serves it.
    ``tidy``: ``release`` first (it waits for the device: not from a thread of its own, which may
    run while another captures a graph)."""
    if not pin or nbytes == 0 or not torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8)
    if tidy:
        release()
    buf = mmap.mmap(-1, nbytes)  # anonymous, page-aligned, zero-filled
    array = np.frombuffer(buf, dtype=np.uint8)
    ptr = array.ctypes.data
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(ptr, nbytes, _PORTABLE_MAPPED) != cudart.cudaError.success:
        del array
        buf.close()
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    # only noted here: the garbage collector may run this inside a CUDA graph capture, where
    # cudaHostUnregister breaks the capture (it did, in test_calibrate on a GPU)
    done = weakref.finalize(array, _released.append, (ptr, buf))
    done.atexit = False  # at exit the process's pages go anyway (and CUDA may be gone first)
    return torch.from_numpy(array)


def pinned_like(t: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """An empty host tensor of ``t``'s shape and dtype, pinned as ``pinned_empty``."""
    return pinned_empty(t.numel() * t.element_size(), pin).view(t.dtype).view(t.shape)


def release() -> None:
    """Unlock and unmap the buffers whose last tensor went. ``pinned_empty`` calls it first (the
    pages freed are mostly a load's staging, given back before the next buffer is taken), never
    while a graph is being captured; it waits for the device first, which may still be copying
    from them."""
    if not _released or torch.cuda.is_current_stream_capturing():
        return
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    while _released:
        ptr, buf = _released.pop()
        try:
            cudart.cudaHostUnregister(ptr)
        finally:
            buf.close()
