"""Remote handles: the ``remote_handles`` switch is checked before anything runs."""

from __future__ import annotations

import pytest


def test_remote_handles_switch_must_be_a_bool():
    from lightning_mp import SMPConfig

    assert SMPConfig()._remote_handles is True and SMPConfig(_remote_handles=False)._remote_handles is False
    with pytest.raises(ValueError, match="remote_handles"):
        SMPConfig(_remote_handles="no")


def _trees():
    import collections

    import torch

    from lightning_mp.pipeline._handles import RemoteValue

    point = collections.namedtuple("point", "x y")
    handle = RemoteValue(None, 1, (0, 1), 0)
    t = torch.arange(3.0)
    return handle, [
        (),
        [],
        {},
        t,
        handle,
        (handle, t, 1, 2.5, None, "s", ..., slice(1, 2), torch.float32, torch.device("cpu")),
        {"b": handle, "a": [t, (3, {"z": None, "y": t})], "c": {}},
        [point(handle, t), collections.OrderedDict(q=t, p=handle), torch.Size([2, 3]), collections.deque([1, t])],
        ((handle,), {"k": [handle, point(1, [t, handle])]}, torch.nn.Parameter(t.clone())),
        torch.return_types.max((t, t)),
    ]


def test_tree_walkers_match_pytree():
    """[Note: walking arguments without pytree's per-leaf calls]: the same leaves in the same order, the same rebuilt
    containers (types, dict key order), ``fn`` called once per leaf in pytree's order, handles as leaves."""
    from torch.utils import _pytree as pytree

    from lightning_mp.pipeline._recorded import _is_remote, tree_leaves, tree_map

    handle, trees = _trees()
    for tree in trees:
        expected = pytree.tree_leaves(tree, is_leaf=_is_remote)
        got = tree_leaves(tree)
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected)), tree

        seen_ours, seen_pytree = [], []
        ours = tree_map(lambda v: seen_ours.append(v) or ("leaf", len(seen_ours)), tree)
        theirs = pytree.tree_map(
            lambda v: seen_pytree.append(v) or ("leaf", len(seen_pytree)), tree, is_leaf=_is_remote
        )
        assert len(seen_ours) == len(seen_pytree) and all(a is b for a, b in zip(seen_ours, seen_pytree)), tree
        assert pytree.tree_structure(ours) == pytree.tree_structure(theirs), tree
        assert pytree.tree_leaves(ours) == pytree.tree_leaves(theirs), tree
        assert type(ours) is type(theirs)
        if isinstance(ours, dict):
            assert list(ours) == list(theirs)  # insertion order kept
