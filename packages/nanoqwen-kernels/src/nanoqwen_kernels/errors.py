"""The package's one exception type: every bad input or failed compile surfaces as a KernelError."""


class KernelError(Exception):
    """Unsupported model dims, a launcher argument of the wrong shape/dtype/layout, or an NVRTC failure
    (the message then carries NVRTC's log)."""
