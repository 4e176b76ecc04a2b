"""Work-directory files that every process can reach: a local path, or a bucket (gs://, s3://, ...)
through etils.epath.

Only process 0 writes run files; the others get what they need through the collectives of
multihost.py, so a process-local disk also works when files are only read back by process 0.
"""
from __future__ import annotations

import os


def is_remote(path: str) -> bool:
  """A URL-style path (gs://bucket/dir) that etils.epath opens, not the local file system."""
  return "://" in str(path)


def path(p: str):
  """An etils.epath.Path: the os backend for local paths, gcsfs / tf.io.gfile for buckets."""
  from etils import epath
  return epath.Path(p)


def abspath(p: str) -> str:
  """os.path.abspath for local paths; a bucket path unchanged (abspath would mangle gs://)."""
  return str(p) if is_remote(p) else os.path.abspath(p)


def write_text_atomic(p: str, text: str) -> None:
  """Readers see the old file or the whole new one: local files via a temp file, fsync and
  os.replace; a bucket object is written whole by one upload (object stores never show a part)."""
  if is_remote(p):
    path(p).write_text(text)
    return
  tmp = f"{p}.tmp.{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, p)
  dir_fd = os.open(os.path.dirname(p) or ".", os.O_RDONLY)
  try:
    os.fsync(dir_fd)  # make the rename itself durable
  finally:
    os.close(dir_fd)
