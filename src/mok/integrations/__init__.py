"""Adapters to model libraries: `mok.integrations.transformers` (Hugging Face) and
`mok.integrations.torchtitan`."""
