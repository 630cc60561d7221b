"""The cache room: what holds a prefix's state and where it lives. The radix tree (`radix_cache`), the KV pool
(`kv_pool`), the one owner of slots and locks (`memory`), the snapshots of recurrent states (`state_snapshots`),
the disk tier, its policy and the cache's persistence across restarts (`disk_tier`, `tier_items`, `tier_file`,
`tier_policy`, `persistence`, `autosave`, `fingerprint`). Imports the engine's shared data (`request`, `openmp`)
and the model room at most; never the step loop or the decode room."""
