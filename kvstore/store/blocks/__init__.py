"""The block engine: chained block keys over any backend, token-exact lookup, reads,
saves, eviction, integrity and tiers (:class:`.prefix.BlockPrefixStore`,
:class:`.tiered.TieredPrefixStore`). Records are opaque bytes here.
"""
