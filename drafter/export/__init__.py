"""Exporting a trained drafter for the serving engines and judging the exported files offline.

- `sglang`: LlamaForCausalLMEagle3 config + weights, checked key by key after writing;
- `vllm`: the speculators format, converted from the SGLang export (ids +1, explicit norm flags);
- `judge`: the exported SGLang files in the reference engine's speculative decoder, greedy;
- `manifest`: what each export records (target, dump, layer ids per engine, vocab hash, metrics).

The stage that runs them is drafter.stages.export.
"""
