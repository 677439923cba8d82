"""Integrations of specdec's kernels with other libraries.

`specdec.integrations.transformers.register()` makes `attn_implementation="specdec"` available to
Hugging Face transformers models (see docs/hf.md). Importing this package imports nothing heavy;
each integration is imported on use.
"""
