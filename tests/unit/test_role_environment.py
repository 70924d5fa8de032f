"""The environment `streamrft run` gives its role processes."""
from streamrft.commands.run import role_environment


def test_roles_wait_passively_and_find_the_broker(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = role_environment("127.0.0.1:9092")
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "STREAMRFT_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9092"}


def test_a_wait_policy_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in role_environment("127.0.0.1:9092")  # inherited from os.environ as set
