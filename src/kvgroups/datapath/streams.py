"""Copies on streams of their own: a stream per direction, the caches' device set in the launching thread,
and an event per transfer, as vLLM's own offloading worker (``v1/kv_offload/cpu/gpu_worker.py``) does.

A :class:`CopyStream` is one direction (loads, or saves) of one worker. Work launched inside
:meth:`CopyStream.launching` runs on that stream with the caches' device current in the calling
thread (a fresh thread's current device is 0: on any other tensor-parallel rank its launches would
address another GPU's memory); ``after_engine=True`` orders it after everything the engine thread
has queued (the forward whose results a save packs) without making any thread wait.
:meth:`CopyStream.record` marks the end of a transfer with an event: a transfer is done when its
:class:`Completion` says so, never when the call that launched it returns. On the CPU every copy is
finished when its call returns: there is no stream and every completion is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Completion(Protocol):
    """The end of one transfer: ``query`` without waiting, ``synchronize`` to wait for it."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    """A transfer whose copies were finished when its call returned (CPU caches)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE: Completion = _Done()


class CopyStream:
    """One direction of a worker's copies on ``device``: its own CUDA stream there, none on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def launching(self, *, after_engine: bool = False) -> Iterator[None]:
        """Launch the enclosed work on this stream, with the caches' device current in this thread;
        ``after_engine``: ordered after everything the calling thread's stream (the engine's) has queued
        so far, which no thread waits for."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device):
            if after_engine:  # the caller's stream, read before this stream becomes the current one
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                yield

    def before_engine(self, completion: Completion) -> None:
        """Order the engine thread's next work (a forward reading what a load wrote) after ``completion``."""
        if isinstance(completion, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(completion)

    def record(self) -> Completion:
        """An event after everything launched on this stream so far."""
        if self.stream is None:
            return DONE
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event
