"""TEST-ONLY stand-in for sgl_kernel on a CPU host without sgl-kernel's CPU build (see ../README.md).

Importing any name works; calling one raises, so nothing silently computes with a missing kernel."""


def _missing(name):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not available on this host")

    op.__name__ = name
    return op


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)


__version__ = "0.0.0"


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Copy KV rows src -> tgt in every layer's buffer (SGLang calls it at draft KV-pool warm-up)."""
    import ctypes

    pairs = [(s, t) for s, t in zip(src_loc.tolist(), tgt_loc.tolist()) if s != t]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for s, t in pairs:
            ctypes.memmove(base + t * stride, base + s * stride, stride)
