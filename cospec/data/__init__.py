"""The data layer, just above the config (the bottom): tokenizers, prompt sources and their verifiers,
and sequence packing. It imports nothing of cospec but the config."""
