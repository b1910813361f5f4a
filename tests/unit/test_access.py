"""The role table of shared/access.py: complete, and what it lets each role do."""

from __future__ import annotations

import hashlib

from shared.access import ACCESS, ROLES, Credentials, permissions, redis_acl, subject_pattern
from shared.subjects import CATALOGUE


def test_every_subject_has_its_publishers_and_subscribers():
    assert set(ACCESS) == set(CATALOGUE)
    for name, a in ACCESS.items():
        assert a.publish and a.subscribe, name
        assert set(a.publish) | set(a.subscribe) <= set(ROLES)


def test_patterns_keep_the_cluster_and_wildcard_the_rest():
    assert subject_pattern("{cluster}.te.{te_id}.task", "c1") == "c1.te.*.task"
    assert subject_pattern("{cluster}.inbox.{owner}.{attempt_key}", "c1") == "c1.inbox.*.*"


def test_roles_get_only_their_own_subjects():
    te = permissions("task_executor", "c1")
    assert "c1.je.submit" not in te["publish"]["allow"]
    assert "c1.cm.heartbeat" in te["publish"]["allow"]
    assert set(te["subscribe"]["allow"]) == {
        "c1.te.*.task",
        "c1.te.*.train",
        "c1.te.*.control",
        "c1.cm.view",
        "c1.cm.member_down",
        "c1.devices.views",  # node pools' devices, for preemption (MESHSERVE_KV_PREEMPTION)
        "c1._INBOX.task_executor.>",  # its own replies, not another role's
    }
    fe = permissions("frontend", "c1")
    assert "c1.te.*.control" not in fe["publish"]["allow"]
    assert "c1.je.submit" in fe["publish"]["allow"]


def test_credentials_go_in_urls_and_acl_lines():
    creds = Credentials.generate()
    assert len(set(creds.secrets.values())) == len(ROLES)
    url = creds.url("redis://127.0.0.1:6379/0", "scaler")
    assert url == f"redis://scaler:{creds.secrets['scaler']}@127.0.0.1:6379/0"
    acl = redis_acl(creds, "c1")
    assert acl.startswith("user default off\n")
    digest = hashlib.sha256(creds.secrets["scaler"].encode()).hexdigest()
    assert f"user scaler on #{digest} ~c1:* " in acl
    assert not any(secret in acl for secret in creds.secrets.values())
