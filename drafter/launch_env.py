"""What every process we start on a GPU host gets in its environment unless the configuration
says otherwise (`serve.env` wins): one place for the rule, used by torchrun launches and servers.

NCCL's NVLink multicast (NVLS) is off: on the GPU hosts this project runs on it hangs or fails
collective setup (see the device notes), and SGLang / vLLM with tensor parallelism use NCCL too.
"""
from __future__ import annotations

from collections.abc import Mapping

GPU_HOST_DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}


def launch_overrides(configured: Mapping[str, str]) -> dict[str, str]:
    """The variables a started process gets on top of the inherited environment."""
    return {**GPU_HOST_DEFAULTS, **configured}
