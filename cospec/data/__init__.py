"""The data layer, at the bottom of the package: tokenizers, prompt sources and their verifiers,
and sequence packing. It imports nothing of cospec but the config."""
