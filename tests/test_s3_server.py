"""The tests' S3 server (tests/s3_server.py): it sees changes made on disk at the next
request, and it costs no CPU while nobody asks it anything (with ``--dir-cache-time 0s``
rclone 1.75 spun on one to three cores from its first upload on, slowing every test
beside it)."""

from __future__ import annotations

import os
import time

import boto3


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_after_uploads_and_listings_costs_no_cpu(own_s3_server):
    own_s3_server.bucket("b")
    client = boto3.client("s3")
    for i in range(3):
        client.put_object(Bucket="b", Key=f"run/x{i}", Body=b"x" * 400_000)
        client.list_objects_v2(Bucket="b", Prefix="run/")
    client.get_object(Bucket="b", Key="run/x0")["Body"].read()
    client.delete_object(Bucket="b", Key="run/x1")
    time.sleep(0.3)  # requests answered
    before = cpu_seconds(own_s3_server.proc.pid)
    time.sleep(2.0)
    spent = cpu_seconds(own_s3_server.proc.pid) - before
    assert spent < 0.3, f"the idle S3 server used {spent:.2f} s of CPU in 2 s"


def test_changes_on_disk_are_seen_at_the_next_request(own_s3_server):
    path = own_s3_server.bucket("b") / "run"
    client = boto3.client("s3")
    client.put_object(Bucket="b", Key="run/obj", Body=b"abc")

    def listed() -> dict[str, int]:
        answer = client.list_objects_v2(Bucket="b", Prefix="run/")
        return {o["Key"]: o["Size"] for o in answer.get("Contents", [])}

    assert listed() == {"run/obj": 3}
    (path / "made-on-disk").write_bytes(b"12345")
    assert listed() == {"run/obj": 3, "run/made-on-disk": 5}
    (path / "obj").write_bytes(b"xbc")  # a flipped byte
    assert client.get_object(Bucket="b", Key="run/obj")["Body"].read() == b"xbc"
    (path / "made-on-disk").unlink()
    assert listed() == {"run/obj": 3}
