"""The dump's data plane: capture the target's aux + final hidden states and store them as shards.

base (devices, dtype, batch plan), hf and vllm (the two capture backends) behind backends,
pipeline (device -> host -> verified uploads, overlapped), shards (the shard format and its
reader), fp8 (the optional fp8 storage)."""
