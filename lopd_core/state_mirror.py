"""Cycle records, checkpoints and reports on shared storage, mirrored to each worker's disk.

With ``workspace.state_uri`` (``s3://bucket/prefix``; the endpoint of an S3-compatible store is
``workspace.s3_endpoint_url``) a cycle's folders — ``runs/<cycle>/`` (record, reports) and
``checkpoints/cycle-<cycle>/`` (training checkpoints, the final student and composer) — live in the bucket.
The pipeline keeps reading and writing local folders: a worker pulls a cycle's folders before it works on the
cycle, and pushes them after every stage (finished or failed) and after every training checkpoint. A cycle
retried on another worker pulls what the first one pushed — the record with its finished stages, the last
checkpoint — and resumes there. Paths recorded by one worker are re-rooted on another
(:func:`relocate`). Without a state URI nothing here runs.

A push makes the remote folder equal to the local one (objects of files removed locally, e.g. pruned
checkpoints, are deleted); a pull downloads what differs in size or is missing. Two workers never push the
same cycle at once: the cycle record's owner and the training slot keep one worker on a cycle.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class StateMirror:
    def __init__(self, uri: str, *, roots: dict[str, Path], storage_options: dict[str, str] | None = None):
        if not uri.startswith("s3://"):
            raise ValueError(f"workspace.state_uri must be an s3:// URI (got {uri!r}); a shared filesystem needs no "
                             "mirror: point workspace.home there instead")
        self.bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self.prefix = prefix.strip("/")
        self.roots = roots
        """Top-level name (``runs``, ``checkpoints``) → the local folder it mirrors."""
        opts = storage_options or {}
        import boto3

        self.client = boto3.client("s3", endpoint_url=opts.get("endpoint"), region_name=opts.get("region"),
                                   aws_access_key_id=opts.get("aws_access_key_id"),
                                   aws_secret_access_key=opts.get("aws_secret_access_key"),
                                   aws_session_token=opts.get("aws_session_token"))

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}".strip("/") if self.prefix else rel

    def _local(self, rel: str) -> Path:
        top, _, rest = rel.partition("/")
        if top not in self.roots:
            raise ValueError(f"no local folder mirrors {top!r} (known: {', '.join(self.roots)})")
        return self.roots[top] / rest if rest else self.roots[top]

    def _remote(self, rel: str) -> dict[str, int]:
        """Relative path → size of every object under ``rel``."""
        out, base = {}, self._key(rel).rstrip("/") + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(base):]] = int(obj["Size"])
        return out

    def pull(self, rel: str) -> int:
        """Download the objects under ``rel`` that are missing locally or differ in size; returns how many."""
        local, n = self._local(rel), 0
        for name, size in self._remote(rel).items():
            path = local / name
            if path.exists() and path.stat().st_size == size:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".partial")
            self.client.download_file(self.bucket, f"{self._key(rel)}/{name}", str(tmp))
            tmp.replace(path)
            n += 1
        if n:
            log.info("state: pulled %d files of %s from s3://%s/%s", n, rel, self.bucket, self._key(rel))
        return n

    def push(self, rel: str) -> int:
        """Make the objects under ``rel`` equal to the local folder; returns how many were uploaded."""
        local = self._local(rel)
        remote = self._remote(rel)
        files = {p.relative_to(local).as_posix(): p for p in local.rglob("*")
                 if p.is_file() and ".partial" not in p.name} if local.exists() else {}
        n = 0
        for name, path in files.items():
            if remote.get(name) == path.stat().st_size and not name.endswith(".json"):
                continue  # same size: unchanged (records and manifests, small, always go)
            self.client.upload_file(str(path), self.bucket, f"{self._key(rel)}/{name}")
            n += 1
        for name in set(remote) - set(files):
            self.client.delete_object(Bucket=self.bucket, Key=f"{self._key(rel)}/{name}")
        return n

    def names(self, rel: str) -> list[str]:
        """The sub-folders under ``rel`` (e.g. the cycle ids under ``runs``)."""
        base = self._key(rel).rstrip("/") + "/"
        out = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base,
                                                                          Delimiter="/"):
            out.update(p["Prefix"][len(base):].strip("/") for p in page.get("CommonPrefixes", []))
        return sorted(out)

    def pull_records(self) -> int:
        """Every cycle's record (``runs/*/cycle.json``), for the commands that list cycles."""
        n = 0
        for cycle_id in self.names("runs"):
            key = f"{self._key('runs')}/{cycle_id}/cycle.json"
            path = self.roots["runs"] / cycle_id / "cycle.json"
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=key)
            except Exception:  # a folder without a record
                continue
            if path.exists() and path.stat().st_size == head["ContentLength"]:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.bucket, key, str(path))
            n += 1
        return n


def mirror_of(ws: Any) -> StateMirror | None:
    """The workspace's mirror, or None without ``state_uri``."""
    if not getattr(ws, "state_uri", ""):
        return None
    return StateMirror(ws.state_uri, roots={"runs": ws.runs_dir, "checkpoints": ws.checkpoints_dir},
                       storage_options=ws.storage_options(for_uri=ws.state_uri))


def relocate(path: str, ws: Any) -> Path:
    """A checkpoint path another worker recorded (``…/cycle-<id>/final/student``), on this worker: the same
    place under this workspace's checkpoints folder when it does not exist here as it is."""
    p = Path(path)
    if not path or p.exists():
        return p
    for i, part in enumerate(p.parts):
        if part.startswith("cycle-"):
            candidate = Path(ws.checkpoints_dir).joinpath(*p.parts[i:])
            if candidate.exists():
                return candidate
    return p
