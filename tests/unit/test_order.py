"""Deterministic execution order across ranks (DESIGN.md invariant), in one process: a follower whose leader
grants nothing raises within the timeout."""

from __future__ import annotations


def test_a_follower_whose_leader_grants_nothing_raises_within_the_timeout() -> None:
    """The leader is alive but silent (stuck): a task waiting on a follower raises instead of waiting forever."""
    import threading

    from lightning_mp.pipeline._scheduler import ComputeToken, GrantOrder, OrderDivergedError

    token = ComputeToken(lambda: None, poll_s=0.05)
    token.order = GrantOrder(publish=None, timeout_s=0.3)
    raised: list[BaseException] = []

    def wait_for_grant() -> None:
        try:
            token.acquire((0,), ("mb", 0, 1))
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            raised.append(err)

    thread = threading.Thread(target=wait_for_grant, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "still waiting for a grant 5 s after a 0.3 s timeout"
    assert isinstance(raised[0], OrderDivergedError) and "order leader" in str(raised[0]), raised
