"""The shared services of a multi-machine setup, started for real without Docker, all bound to 127.0.0.1.

    python infra/services.py up --dir DIR [--worker]     # PostgreSQL, S3 (moto), Prefect server, MLflow server
    python infra/services.py down --dir DIR

``up`` starts, in ``DIR``:

- **PostgreSQL** (the machine's ``initdb``/``pg_ctl``) with two databases, ``prefect`` and ``mlflow``. PostgreSQL
  refuses to run as root: as root the cluster belongs to an unprivileged user (``--pg-user``, default
  ``nobody``). Authentication is ``trust`` on 127.0.0.1 — for a machine of your own; put passwords and TLS in
  front of anything others can reach.
- **an S3-compatible server** (moto's, from the package registry) with the bucket ``lopd`` — or use MinIO/S3
  with ``--s3-endpoint URL`` and your own credentials;
- **the Prefect server** on the ``prefect`` database;
- **the MLflow server** on the ``mlflow`` database, artifacts proxied to ``s3://lopd/mlartifacts``;
- with ``--worker``: ``lopd deploy --pool lopd-process`` and a Prefect worker on that pool.

It writes ``DIR/services.env`` (``source`` it: PREFECT_API_URL, AWS_*, the S3 endpoint) and
``DIR/cluster.yaml``, a profile (``--profile DIR/cluster.yaml``) whose workspace lives in the services:
LanceDB on ``s3://lopd/lance``, cycle records and checkpoints on ``s3://lopd/state``, MLflow tracking on the
server. ``down`` stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lopd_core.workspace import free_port

BIN = Path(sys.executable).parent
BUCKET = "lopd"
ACCESS = {"AWS_ACCESS_KEY_ID": "lopd", "AWS_SECRET_ACCESS_KEY": "lopd-secret", "AWS_REGION": "us-east-1"}


def pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise SystemExit(f"{name} not found: install PostgreSQL (Debian: apt install postgresql)")


def as_user(user: str, cmd: list[str]) -> list[str]:
    """``cmd`` as ``user`` when this process is root (PostgreSQL refuses root), else as is."""
    return ["runuser", "-u", user, "--", *cmd] if os.geteuid() == 0 else cmd


def wait_for(what: str, check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} did not come up within {timeout:.0f} s (see its log in the services folder)")


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (a local health check)
        return r.status == 200


def spawn(state: dict, name: str, cmd: list[str], folder: Path, env: dict[str, str]) -> None:
    log = (folder / f"{name}.log").open("a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    state["pids"][name] = proc.pid


def up(args) -> dict:
    folder = args.dir.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    state_file = folder / "services.json"
    if state_file.exists():
        raise SystemExit(f"{folder} already runs services ({state_file}); `down` first")
    state: dict = {"pids": {}, "dir": str(folder)}
    env = {**os.environ, **ACCESS, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}

    # --- PostgreSQL ----------------------------------------------------------------------------------
    pg_dir, pg_port = folder / "pg", free_port()
    pg_dir.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(pg_dir, args.pg_user)
    run = lambda cmd: subprocess.run(as_user(args.pg_user, cmd), check=True, capture_output=True, text=True)  # noqa: E731
    if not (pg_dir / "PG_VERSION").exists():
        run([pg_bin("initdb"), "-D", str(pg_dir), "--auth=trust", "-U", "lopd", "--encoding=UTF8"])
    run([pg_bin("pg_ctl"), "-D", str(pg_dir), "-l", str(pg_dir / "server.log"), "-w", "start",
         "-o", f"-h 127.0.0.1 -p {pg_port} -k {pg_dir}"])
    state["postgres"] = {"port": pg_port, "data": str(pg_dir), "user": args.pg_user}
    state_file.write_text(json.dumps(state))  # from here on `down` can stop what started
    for db in ("prefect", "mlflow"):
        run([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(pg_port), "-U", "lopd", db])

    # --- S3 ------------------------------------------------------------------------------------------
    if args.s3_endpoint:
        s3 = args.s3_endpoint
    else:
        s3_port = free_port()
        spawn(state, "s3", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], folder, env)
        s3 = f"http://127.0.0.1:{s3_port}"
        import boto3

        client = boto3.client("s3", endpoint_url=s3, aws_access_key_id=ACCESS["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=ACCESS["AWS_SECRET_ACCESS_KEY"], region_name=ACCESS["AWS_REGION"])
        wait_for("the S3 server", lambda: client.create_bucket(Bucket=BUCKET) is not None, timeout=60)
    state["s3"] = s3
    state_file.write_text(json.dumps(state))

    # --- Prefect and MLflow servers ----------------------------------------------------------------------
    prefect_port, mlflow_port = free_port(), free_port()
    pg = f"lopd@127.0.0.1:{pg_port}"
    spawn(state, "prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
          folder, {**env, "PREFECT_HOME": str(folder / "prefect"),
                   "PREFECT_API_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{pg}/prefect"})
    spawn(state, "mlflow", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                            "--backend-store-uri", f"postgresql+psycopg2://{pg}/mlflow",
                            "--artifacts-destination", f"s3://{BUCKET}/mlartifacts", "--workers", "1"],
          folder, {**env, "MLFLOW_S3_ENDPOINT_URL": s3})
    state.update(prefect_api=f"http://127.0.0.1:{prefect_port}/api", mlflow=f"http://127.0.0.1:{mlflow_port}")
    state_file.write_text(json.dumps(state))
    wait_for("the Prefect server", lambda: http_ok(f"{state['prefect_api']}/health"))
    wait_for("the MLflow server", lambda: http_ok(f"{state['mlflow']}/health"))

    # --- what a worker (or you) needs -------------------------------------------------------------------
    exports = {"PREFECT_API_URL": state["prefect_api"], "MLFLOW_S3_ENDPOINT_URL": s3, **ACCESS}
    (folder / "services.env").write_text("".join(f"export {k}={v}\n" for k, v in exports.items()))
    profile = folder / "cluster.yaml"
    profile.write_text(
        f"# written by infra/services.py: the demo profile with its workspace in the shared services\n"
        f"extends: {args.extends}\n"
        f"workspace:\n  lance_uri: s3://{BUCKET}/lance\n  mlflow_tracking_uri: {state['mlflow']}\n"
        f"  mlflow_artifacts_uri: mlflow-artifacts:/\n  s3_endpoint_url: {s3}\n  state_uri: s3://{BUCKET}/state\n")
    state["profile"] = str(profile)
    if args.worker:
        worker_env = {**env, **exports, "LOPD_HOME": str(args.lopd_home or folder / "lopd")}
        subprocess.run([str(BIN / "lopd"), "deploy", "--pool", args.pool, "--profile", str(profile)], check=True,
                       env=worker_env)
        spawn(state, "worker", [str(BIN / "prefect"), "worker", "start", "--pool", args.pool], folder, worker_env)
    state_file.write_text(json.dumps(state, indent=2))
    print(json.dumps(state, indent=2))
    return state


def down(args) -> None:
    folder = args.dir.resolve()
    state_file = folder / "services.json"
    if not state_file.exists():
        print(f"nothing runs from {folder}")
        return
    state = json.loads(state_file.read_text())
    for name, pid in reversed(list(state["pids"].items())):
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(pid, signal.SIGKILL)
        print(f"stopped {name}")
    if "postgres" in state:
        pg = state["postgres"]
        subprocess.run(as_user(pg["user"], [pg_bin("pg_ctl"), "-D", pg["data"], "-m", "fast", "-w", "stop"]),
                       capture_output=True)
        print("stopped postgres")
    state_file.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, required=True, help="folder of the services' data, logs and state")
    parser.add_argument("--pg-user", default="nobody", help="the unprivileged owner of the PostgreSQL cluster (as root)")
    parser.add_argument("--s3-endpoint", default="", help="an existing S3-compatible endpoint instead of moto's server")
    parser.add_argument("--extends", default="demo", help="the profile cluster.yaml extends")
    parser.add_argument("--worker", action="store_true", help="also `lopd deploy` and start a worker on --pool")
    parser.add_argument("--pool", default="lopd-process")
    parser.add_argument("--lopd-home", type=Path, default=None, help="LOPD_HOME of the worker (default DIR/lopd)")
    args = parser.parse_args(argv)
    up(args) if args.action == "up" else down(args)


if __name__ == "__main__":
    main()
