"""Reads the served model's files once they are all there, in a thread of its own.

The launcher starts a `ModelWatch` with the engine. Every `interval` seconds it looks for the
model's directory (`model_files.model_dir`: vLLM may still be downloading) and, once the
download is complete or the engine said its weights are loaded, reads config.json and the
safetensors headers (`read_model_files`: headers only, but a 160-shard checkpoint is still
160 opens) and publishes the result. After one successful read it stops and reads nothing
again; a read that fails is published too (the operator sees why) and retried a few times.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from rankguard_agent.model_files import ModelFiles, download_complete, model_dir, model_name, read_model_files

log = logging.getLogger("rankguard_agent.model")

DEFAULT_INTERVAL_S = 2.0
MAX_FAILED_READS = 5


class ModelWatch:
    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        publish: Callable[[ModelFiles], None],
        weights_loaded: Callable[[], bool] = lambda: False,
        interval: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.publish = publish
        self.weights_loaded = weights_loaded
        self.interval = interval
        self.failed_reads = 0
        self.done = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """One look; True when there is nothing more to do."""
        loaded = self.weights_loaded()
        path = model_dir(self.argv, self.env)
        if path is None:
            if loaded:  # the engine has its weights, but not from a directory rankguard can find
                name = model_name(self.argv)
                if name:
                    self.publish(ModelFiles(name[:4096], error="the model's files were not found"))
            return loaded
        if not loaded and not download_complete(path):
            return False
        found = read_model_files(path)
        self.publish(found)
        if found.error is None:
            log.info(
                "read the model's files at %s: %d tensor(s) in %d file(s)",
                found.path,
                found.tensors,
                found.checkpoint.files if found.checkpoint else 0,
            )
            return True
        self.failed_reads += 1
        log.warning("cannot read the model's files at %s: %s", found.path, found.error)
        return loaded or self.failed_reads >= MAX_FAILED_READS

    def _run(self) -> None:
        try:
            while not self.done and not self._stop.is_set():
                self.done = self.poll()
                if not self.done:
                    self._stop.wait(self.interval)
        except Exception:  # pragma: no cover - model_files never raises; a bug must not spread
            log.exception("reading the model's files failed")

    def start(self) -> None:
        if self._thread is None and model_name(self.argv):
            self._thread = threading.Thread(target=self._run, name="rankguard-model-files", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
