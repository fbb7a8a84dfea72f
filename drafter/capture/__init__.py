"""The dump's data plane: capture the target's aux + final hidden states and store them as shards.

base (devices, dtype, batch plan), hf and vllm (the two capture backends) behind backends,
pipeline (device -> host -> verified uploads, overlapped). The shard format and its reader, and the
optional fp8 storage, are what the dump hands training: drafter.contracts.shards and .fp8."""
