"""Regenerating the corpus' answers with the target: generate (requests, shards, the
re-tokenization check, the servers), plan (what an output is made of, incremental reuse, counts)."""
