"""Every error pagedkv raises on bad input derives from PagedKVError.

Messages name the offending value and the fix, so a user never has to read a traceback.
"""


class PagedKVError(Exception):
    """Base class: bad input or an impossible request, with a message that says how to fix it."""


class SpecError(PagedKVError, ValueError):
    """A KV quantization spec or pool layout that cannot work (e.g. group size not dividing head_dim)."""


class UnsupportedModelError(PagedKVError):
    """The model uses a feature the paged op cannot express (mask-only attention, ALiBi, MLA, ...)."""


class NonFiniteKVError(PagedKVError, ValueError):
    """NaN or Inf reached the KV cache writer."""


class PoolExhausted(PagedKVError):
    """The block pool has fewer free blocks than a request needs. Nothing was changed."""

    def __init__(self, requested_blocks: int, free_blocks: int, what: str = ""):
        self.requested_blocks = requested_blocks
        self.free_blocks = free_blocks
        detail = f" for {what}" if what else ""
        super().__init__(
            f"KV block pool exhausted{detail}: needs {requested_blocks} block(s), only {free_blocks} free. "
            "Clear a conversation, use a larger pool (--pool-mb / --pool-tokens), or choose the "
            "'evict' or 'sliding' pool policy."
        )


class PoolStateError(PagedKVError):
    """A block-pool call that contradicts the pool's state (double free, unknown sequence, ...)."""


class ArtifactError(PagedKVError):
    """An exported artifact or manifest is missing, corrupted, or does not match this installation."""


class KernelLibraryMissing(PagedKVError):
    """A native kernel library was requested but has not been built."""
