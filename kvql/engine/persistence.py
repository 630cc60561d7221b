"""Persistence of an engine's cache (`Persistence`, mixed into `kvql.engine.engine.Engine`): its radix tree and
KV written to a snapshot file and read back (`kvql.engine.snapshot` holds the format and its checks), and
the fingerprint a snapshot must carry to be loaded here. Uses the engine's state lock, tree, pool and
scheduler."""

from __future__ import annotations

from . import openmp, snapshot


class Persistence:
    def fingerprint(self) -> dict[str, str]:
        """What a snapshot must have been saved with to be loaded here (snapshot.fingerprint); computed
        once: weights changed under a live engine would make its cache stale anyway."""
        if self._fingerprint is None:
            self._fingerprint = snapshot.fingerprint(self.runner.model, self.tokenizer, self.pool)
        return self._fingerprint

    @openmp.releases_caller
    def save_cache(self, path) -> dict:
        """Write the radix tree and its KV to `path` (snapshot.save). Steps run between the layers'
        gathers (snapshot.write); if they evict meanwhile, the save starts again holding the engine."""
        fp = self.fingerprint()
        try:
            pending = snapshot.write(self.tree, self.pool, path, fp, self._state)
        except snapshot.CacheChanged:
            with self._state:
                pending = snapshot.write(self.tree, self.pool, path, fp, self._state)
        return pending.commit()

    @openmp.releases_caller
    def load_cache(self, path) -> dict:
        """Replace the cached tokens with the snapshot at `path` (snapshot.load), within the pool's
        budget. Needs no request running (RuntimeError). SnapshotError if the snapshot is another
        model's or damaged: the cache is then left empty."""
        with self._state:
            if self.scheduler.running:
                raise RuntimeError(f"load_cache needs an idle engine; {len(self.scheduler.running)} requests are running")
            self.tree.reset()
            return snapshot.load(self.tree, self.pool, path, self.fingerprint(),
                                 int(self.runner.model.config.get_text_config().vocab_size))
