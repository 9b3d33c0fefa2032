"""The few device operations the backend needs, behind one small interface with two implementations.

`CupyDevice` is the real one: a non-blocking CuPy stream every launch goes to, H2D/D2H copies, CUDA
graph capture and replay, free-memory queries, pinned staging for the weight upload.

`HostDevice` does the same with numpy arrays in host memory. With `host_kernels.HostKernels` (numpy
launchers with the KernelSet signatures) it runs the whole backend, graph capture included, on a machine
without a GPU: CI checks the backend's plumbing (buffer shapes, the order of launches, what lives in
device state and what a graph would bake in) against the reference backend. Its "graph" records each
launcher call with its arguments during capture and replays the list, which is what a CUDA graph does:
arrays are read at replay time, Python scalars are frozen at capture time.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from .plan import UploadPlan, chunks

STAGING_BYTES = 64 << 20  # one pinned staging buffer; two alternate so a memcpy overlaps the next fill


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar then
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


class CupyDevice:
    name: str

    def __init__(self):
        import cupy

        self.cp = cupy
        self.xp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    # --- memory ---
    def mem_info(self) -> tuple[int, int]:
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def is_oom(self, e: BaseException) -> bool:
        if isinstance(e, self.cp.cuda.memory.OutOfMemoryError):
            return True
        return "out of memory" in str(e).lower() or "cudaErrorMemoryAllocation" in str(e)

    def release_cached(self) -> None:
        """Give the memory pool's unused blocks back to the driver (after a failed allocation)."""
        self.cp.get_default_memory_pool().free_all_blocks()

    # --- copies, all ordered on self.stream ---
    def h2d(self, dst, src: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(src), stream=self.stream)

    def d2h(self, src) -> np.ndarray:
        return src.get(stream=self.stream)  # blocks until the stream reaches it

    def pinned(self, shape, dtype) -> np.ndarray:
        """A host array in page-locked memory: the target of d2h_async (a copy to pageable memory would
        make the host wait for it)."""
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)

    def event(self):
        """A reusable completion marker for d2h_async."""
        return self.cp.cuda.Event(disable_timing=True)

    def d2h_async(self, src, out: np.ndarray, event) -> None:
        """Enqueue src -> out (pinned, as many bytes as src) on the stream and record `event` after it;
        nothing waits. wait(event) then makes out's bytes readable."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(out.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost, self.stream.ptr)
        event.record(self.stream)

    def wait(self, event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def use(self):
        """Context: CuPy ops and the kernel launchers go to self.stream."""
        return self.stream

    # --- graphs ---
    def capture(self, launch_all):
        """Capture launch_all()'s launches into a graph without running them."""
        with self.stream:
            self.stream.begin_capture()
            try:
                launch_all()
            finally:
                graph = self.stream.end_capture()
        graph.upload(self.stream)
        return graph

    def replay(self, graph) -> None:
        graph.launch(self.stream)

    def graph_kernel_nodes(self, graph) -> int | None:
        """Kernel nodes of a captured graph, read from its DOT dump (None when unreadable).
        NANOQWEN_GRAPH_DOT=path also writes the dump there (scripts/gpu_all.sh keeps it)."""
        try:
            dot = graph.debug_dot_str()
        except Exception:
            return None
        path = os.environ.get("NANOQWEN_GRAPH_DOT")
        if path:
            with contextlib.suppress(OSError):
                with open(path, "w") as f:
                    f.write(dot)
        return count_kernel_nodes(dot) or None

    # --- weight upload ---
    def upload(self, plan: UploadPlan, tensor_of, progress: bool) -> dict:
        """Allocate every plan buffer and fill it from host arrays through pinned staging.

        tensor_of(name) -> a C-contiguous numpy view (the file's mmap). Two pinned buffers alternate: the
        CPU fills one (page-cache read + memcpy) while the copy engine drains the other; an event per
        buffer says when it may be refilled.
        """
        cp = self.cp
        bufs = {k: cp.empty(shape, dtype=dt) for k, (shape, dt) in plan.buffers.items()}
        staging = [cp.cuda.alloc_pinned_memory(STAGING_BYTES) for _ in range(2)]
        views = [np.frombuffer(m, dtype=np.uint8, count=STAGING_BYTES) for m in staging]
        events = [None, None]
        bar = _progress(sum(c.nbytes for c in plan.copies), progress, "upload")
        slot = 0
        h2d = cp.cuda.runtime.memcpyHostToDevice
        try:
            for c in plan.copies:
                src = np.ascontiguousarray(tensor_of(c.src)).reshape(-1).view(np.uint8)
                base = bufs[c.key].data.ptr + c.offset
                for off, n in chunks(c.nbytes, STAGING_BYTES):
                    if events[slot] is not None:
                        events[slot].synchronize()
                    views[slot][:n] = src[off:off + n]
                    cp.cuda.runtime.memcpyAsync(base + off, staging[slot].ptr, n, h2d, self.stream.ptr)
                    ev = cp.cuda.Event(disable_timing=True)
                    ev.record(self.stream)
                    events[slot] = ev
                    slot ^= 1
                    if bar is not None:
                        bar.update(n)
            self.stream.synchronize()
        finally:
            if bar is not None:
                bar.close()
        for k, target in plan.aliases.items():
            bufs[k] = bufs[target]
        return bufs


class HostDevice:
    """numpy stand-in for CupyDevice (see the module doc)."""

    name = "host (numpy stand-in)"

    def __init__(self, free_bytes: int = 8 << 30):
        self.xp = np
        self._free = free_bytes
        self.recording: list | None = None  # launcher calls collected while "capturing"

    def mem_info(self) -> tuple[int, int]:
        return self._free, self._free

    def is_oom(self, e: BaseException) -> bool:
        return isinstance(e, MemoryError)

    def release_cached(self) -> None:
        pass

    def h2d(self, dst, src: np.ndarray) -> None:
        dst[...] = src

    def d2h(self, src) -> np.ndarray:
        return np.array(src, copy=True)

    def pinned(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def event(self):
        return None

    def d2h_async(self, src, out: np.ndarray, event) -> None:
        out.reshape(-1)[: src.size] = np.asarray(src).reshape(-1)  # the host "device" ran everything already

    def wait(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def use(self):
        return contextlib.nullcontext()

    def capture(self, launch_all):
        self.recording = []
        try:
            launch_all()
            graph = self.recording
        finally:
            self.recording = None
        return graph

    def replay(self, graph) -> None:
        for fn, args, kwargs in graph:
            fn(*args, **kwargs)

    def graph_kernel_nodes(self, graph) -> int | None:
        return len(graph)

    def upload(self, plan: UploadPlan, tensor_of, progress: bool) -> dict:
        bufs = {k: np.empty(shape, dtype=dt) for k, (shape, dt) in plan.buffers.items()}
        for c in plan.copies:
            src = np.ascontiguousarray(tensor_of(c.src)).reshape(-1).view(np.uint8)
            bufs[c.key].reshape(-1).view(np.uint8)[c.offset:c.offset + c.nbytes] = src
        for k, target in plan.aliases.items():
            bufs[k] = bufs[target]
        return bufs


def count_kernel_nodes(dot: str) -> int:
    """Kernel nodes in a CUDA graph's DOT dump. cudaGraphDebugDotPrint draws a kernel node as an
    octagon labelled with the kernel's name (seen on the H200 here, CUDA 13: 173 for a 7B decode step);
    memcpy/memset nodes have other shapes."""
    return sum(1 for line in dot.splitlines()
               if "_node_" in line and "->" not in line and 'shape="octagon"' in line)


class Timer:
    """Seconds of a host-side region (the load report)."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *a):
        self.s = time.perf_counter() - self.t0
