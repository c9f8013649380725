"""The zero-bubble schedule: each backward split into its input gradient, now, and its weight gradient, later.

[Note: zero-bubble] With ``pipeline="zero_bubble"`` (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism")
every backward a rank runs (the driver's ``loss.backward()``, a served BACKWARD or FETCH_BACKWARD) is split in two
passes over the same autograd graph:

- the *input* pass (I) runs now, under the backward's task: only the nodes on a path from the roots to the
  gradients someone waits for: the received leaves whose gradients go back upstream, and the anchor of every
  remote call in the graph (``comm/_autograd.py``), so each remote backward sends its gradients at once. Its
  reply leaves as soon as it is done, so the upstream stage starts its own backward one weight pass earlier.
- the *weight* pass (W) runs later, as its own task (``Phase.WEIGHT``, ordered after the next backward: [Note: 1F1B
  priorities] in ``_scheduler.py``), and whenever the stage would wait for a message, so it fills the bubble. It
  computes the rest: what leads only to parameters (and other leaves).

How the graph is cut works for any graph the engine runs (control flow, module reuse, tied weights, shapes changing
per step), where torch's ``stage_backward_input`` / ``stage_backward_weight`` (``torch.distributed.pipelining``) need
a split stage module: nodes leading to a wanted gradient are the I set; nodes outside it that lead to a leaf are the
W set; an I node with an edge into the W set is a *boundary*, and the gradients flowing into it are captured (node
pre-hook) in the I pass. The W pass (1) runs each boundary once more, alone, from its captured gradients to its W
edges (``autograd.grad`` with ``GradientEdge`` outputs and inputs: a Linear's ``AddmmBackward0`` computes ``dy W`` in
the I pass and ``x^T dy`` here), then (2) runs one ``autograd.backward`` from all W edges: the parameters accumulate
once per backward, in autograd's usual order, so the ordered-accumulation hooks (``_grads.py``) and the
data-parallel reducer's hooks fire there, on the weight pass, and the sums equal the unsplit backward's (bitwise in
the tests). Some W nodes are *cut* instead: the I pass captures their whole incoming gradient (an ``autograd.grad``
input edge) and the W pass starts there: the W children of a Python ``autograd.Function`` (it computes all its input
gradients at once, and a remote call's backward sends a message, so it must not run twice), and a boundary's child
that the boundary's own run would also reach another way (through another boundary: a reused module's bias is a W
edge of both of its calls, and unlike torch's parameter groups, ``autograd.grad`` would run one call's backward into
the other and count it twice); a cut leaf (such a bias) is accumulated in the I pass. A cut node's W ancestors join
the I pass. Gradients are never captured at a leaf (``autograd.grad`` would run its tensor hooks on the captured
value): a leaf accumulates once per backward, its hooks with it. With activation checkpointing
each engine call of the W pass that unpacks a checkpointed module's saved tensors recomputes its forward
(``torch.utils.checkpoint`` recomputes once per graph task): once per boundary in it, plus one. The W pass holds the
graph below its boundaries until it runs (as torch's); the schedule keeps at most one W pass pending beyond 1F1B's
microbatches in flight when no stage waits ([Note: 1F1B priorities]).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from lightning_mp.comm import REMOTE_ANCHOR
from lightning_mp.pipeline._core import SessionCore
from lightning_mp.pipeline._messages import POLL_S, Phase, PipelineError, Task, as_task, current_task

__all__ = ["WeightPass", "WeightPasses", "run_backward", "split_backward"]

_MULTI = object()  # a W node's label: reached from more than one entry


@dataclass
class _Boundary:
    """A node of the I pass with edges into the W set: the gradients flowing into it (captured in the I pass by a
    pre-hook) and its W edges ``(child, input number)``, which the W pass gets by running it alone once more."""

    node: Node
    edges: list[tuple[Node, int]]
    grads: tuple | None = None

    def capture(self, grad_outputs: tuple) -> None:
        self.grads = grad_outputs

    def weight_edges(self, retain_graph: bool) -> list[tuple[GradientEdge, torch.Tensor]]:
        """Run this node alone once more from its captured gradients: a leaf it feeds directly accumulates now (only
        this node reaches it); the gradient of each other W edge is returned, for the W pass's last backward."""
        outputs = [(GradientEdge(self.node, k), g) for k, g in enumerate(self.grads or ()) if g is not None]
        if not outputs:  # nothing flowed into it (an output without a gradient): no contribution
            return []
        leaves = [child.variable for child, _ in self.edges if _is_leaf(child)]
        others = {edge for edge in self.edges if not _is_leaf(edge[0])}
        capture = _EdgeCapture(lambda node, child, nr: (child, nr) in others)
        handle = capture.hook(self.node)
        try:  # the other W nodes are inputs, so this node computes their edges (and they run, computing nothing)
            torch.autograd.backward([e for e, _ in outputs], [g for _, g in outputs],
                                    inputs=[*leaves, *(GradientEdge(c, nr) for c, nr in others)],
                                    retain_graph=retain_graph or bool(others))
        finally:
            handle.remove()
        return capture.captured


@dataclass
class _EdgeCapture:
    """Post-hooks on the I nodes that compute W edges in the I pass (an opaque node: a Python ``autograd.Function``
    computes all its input gradients; a parent of a cut node): each W edge's gradient, in the order autograd made
    them (a cut node with two parents sums them in that order, as one backward does)."""

    wanted: Callable[[Node, Node, int], bool]  # (node, child, input number) -> capture that edge
    captured: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)

    def hook(self, node: Node) -> Any:
        children = [(i, child, nr) for i, (child, nr) in enumerate(node.next_functions)
                    if child is not None and self.wanted(node, child, nr)]

        def record(grad_inputs: tuple, grad_outputs: tuple) -> None:
            for i, child, nr in children:
                if grad_inputs[i] is not None:
                    self.captured.append((GradientEdge(child, nr), grad_inputs[i]))

        return node.register_hook(record)


@dataclass
class WeightPass:
    """The deferred weight-gradient half of one backward (see [Note: zero-bubble]).

    Attributes:
        boundaries: the I nodes whose W edges this pass runs, with their captured gradients.
        roots: W edges whose gradients the I pass captured, and roots of the backward in the W set.
        retain_graph: the backward kept its graph for another backward through it (a fetch's, ``_outputs.py``).
    """

    boundaries: list[_Boundary]
    roots: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    retain_graph: bool = False

    def run(self) -> None:
        """Compute the weight gradients: each boundary's W edges, then one backward from every W edge into the
        leaves (their hooks fire here)."""
        pairs = [pair for boundary in self.boundaries for pair in boundary.weight_edges(self.retain_graph)]
        pairs += self.roots
        self.boundaries, self.roots = [], []  # the graph is released with this pass
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs], retain_graph=self.retain_graph)


def split_backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    wanted: Sequence[torch.Tensor],
    *,
    retain_graph: bool = False,
) -> WeightPass | None:
    """Run the input pass of ``backward(roots, grads)`` now; return its weight pass (``None``: nothing deferred).

    Args:
        roots: the tensors to differentiate (outputs, or a scalar loss).
        grads: their gradients (``None`` for a scalar: ones, as ``torch.autograd.backward``).
        wanted: leaves whose ``.grad`` must be complete after the input pass (the received leaves whose gradients
            go upstream); every remote call's anchor is added.
        retain_graph: keep the graph after both passes (another backward will run through it).

    Returns:
        The :class:`WeightPass` to run later, once, on a thread set up as the backward's (its microbatch's task).
    """
    roots, grads = _differentiable(roots, grads)
    if not roots:
        return None
    root_nodes = [_node_of(t) for t in roots]
    targets = {_node_of(t): t for t in (*wanted, REMOTE_ANCHOR) if t.requires_grad}
    cuts: set[Node] = set()
    children: dict[Node, list[tuple[Node, int]]] = {}  # each node's, read once for every round
    while True:
        graph = _Graph(root_nodes, set(targets), cuts, children)
        more = graph.new_cuts() - cuts
        if not more:
            break
        for node in more:  # a leaf is accumulated in the I pass; another node's gradient is captured there
            if _is_leaf(node):
                targets[node] = node.variable
            else:
                cuts.add(node)
    boundaries = [_Boundary(node, edges) for node, edges in graph.boundaries()]
    captured = _input_pass(roots, grads, root_nodes, graph, targets, boundaries)
    w_roots = captured + [(GradientEdge(node, _output_nr(roots[k])), grads[k])
                          for k, node in enumerate(root_nodes) if node in graph.weight_set]
    if not boundaries and not w_roots:
        return None
    return WeightPass(boundaries, w_roots, retain_graph)


def _input_pass(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor],
    root_nodes: list[Node],
    graph: _Graph,
    targets: dict[Node, torch.Tensor],
    boundaries: list[_Boundary],
) -> list[tuple[GradientEdge, torch.Tensor]]:
    """Run the I pass: accumulate the targets' ``.grad``, capture the boundaries' incoming gradients and the W edges
    the I pass computes (returned)."""
    in_i = [k for k, node in enumerate(root_nodes) if node in graph.input_set]
    if not in_i:
        return []
    leaves = [t for node, t in targets.items() if node in graph.input_set]
    capture = _EdgeCapture(lambda node, child, nr: child in graph.cuts or (_opaque(node) and child in graph.weight_set))
    handles = [b.node.register_prehook(b.capture) for b in boundaries]
    handles += [capture.hook(node) for node in graph.computing_weight_edges()]
    try:
        torch.autograd.backward([roots[k] for k in in_i], [grads[k] for k in in_i],
                                inputs=[*leaves, *graph.cut_edges()], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return capture.captured


def _differentiable(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple[list, list]:
    """The roots that have a graph, with their gradients made explicit (ones for a scalar, as autograd does)."""
    kept_roots, kept_grads = [], []
    for root, grad in zip(roots, grads):
        if not root.requires_grad:
            continue
        if grad is None:
            if root.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            grad = torch.ones_like(root, memory_format=torch.preserve_format)
        kept_roots.append(root)
        kept_grads.append(grad)
    return kept_roots, kept_grads


def _node_of(tensor: torch.Tensor) -> Node:
    """The tensor's ``grad_fn``, or a leaf's gradient accumulator (made through a view, as torch's
    ``_get_grad_fn_or_grad_acc``)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]


def _output_nr(tensor: torch.Tensor) -> int:
    return tensor.output_nr if tensor.grad_fn is not None else 0


def _children(node: Node) -> list[tuple[Node, int]]:
    return [(child, nr) for child, nr in node.next_functions if child is not None]


def _is_leaf(node: Node) -> bool:
    return hasattr(node, "variable")  # an AccumulateGrad


class _Graph:
    """One backward's graph split into the I set (leads to a wanted leaf or to a cut node) and the W set (the rest
    that leads to a leaf). A cut node is a W node whose whole incoming gradient the I pass captures.

    ``children``: each node's ``_children``, shared by the graphs of one backward (``split_backward`` builds one per
    round of cuts): ``next_functions`` makes a new tuple per read, and the walks below read each node's several times.
    The walks are loops, not generator expressions (a Python call per item), over the same nodes in the same order.
    """

    def __init__(self, roots: list[Node], targets: set[Node], cuts: set[Node],
                 children: dict[Node, list[tuple[Node, int]]] | None = None) -> None:
        self.children = kids = children if children is not None else {}
        self.nodes: list[Node] = []  # post-order: every node after its children
        to_target: dict[Node, bool] = {}
        to_leaf: dict[Node, bool] = {}
        stack = [(node, False) for node in roots]
        while stack:
            node, done = stack.pop()
            if done:
                edges = kids[node]
                reaches = node in targets
                if not reaches:
                    for c, _ in edges:
                        if to_target[c] or c in cuts:
                            reaches = True
                            break
                to_target[node] = reaches
                reaches = hasattr(node, "variable") and node not in targets  # a leaf (``_is_leaf``)
                if not reaches:
                    for c, _ in edges:
                        if to_leaf[c]:
                            reaches = True
                            break
                to_leaf[node] = reaches
                self.nodes.append(node)
            elif node not in to_leaf:
                to_leaf[node] = False  # visiting (autograd graphs have no cycles)
                stack.append((node, True))
                edges = kids.get(node)
                if edges is None:
                    edges = kids[node] = _children(node)
                for c, _ in edges:
                    if c not in to_leaf:
                        stack.append((c, False))
        self.input_set = {n for n in self.nodes if to_target[n]}
        self.weight_set = {n for n in self.nodes if not to_target[n] and to_leaf[n]}
        self.cuts = cuts & self.weight_set

    def boundaries(self) -> list[tuple[Node, list[tuple[Node, int]]]]:
        """Each I node (not opaque) with edges into the W set other than cut nodes, with those distinct edges, in
        autograd's order (the node made last runs first)."""
        found = []
        weight_set, cuts, kids = self.weight_set, self.cuts, self.children
        for node in self.nodes:
            if node in self.input_set and not isinstance(node, BackwardCFunction):  # not ``_opaque``
                edges = [e for e in dict.fromkeys(kids[node]) if e[0] in weight_set and e[0] not in cuts]
                if edges:
                    found.append((node, edges))
        return sorted(found, key=lambda item: -item[0]._sequence_nr())

    def computing_weight_edges(self) -> list[Node]:
        """The I nodes that compute W edges in the I pass: opaque nodes with W children, parents of cut nodes."""
        found = []
        weight_set, cuts, kids = self.weight_set, self.cuts, self.children
        for n in self.input_set:
            opaque = isinstance(n, BackwardCFunction)
            for c, _ in kids[n]:
                if c in cuts or (opaque and c in weight_set):
                    found.append(n)
                    break
        return found

    def cut_edges(self) -> list[GradientEdge]:
        """The edges from the I set into cut nodes, each once (inputs of the I pass, so their parents compute them)."""
        cuts, kids = self.cuts, self.children
        edges = dict.fromkeys(edge for n in self.input_set for edge in kids[n] if edge[0] in cuts) if cuts else {}
        return [GradientEdge(c, nr) for c, nr in edges]

    def new_cuts(self) -> set[Node]:
        """The W children of boundaries that a boundary's own run would reach some other way than its direct edge
        (see [Note: zero-bubble]). Every W node is labelled with the entry it is reached through (a boundary's or an
        opaque node's child, a cut node), or as reached through several."""
        labels: dict[Node, object] = {}
        reruns: set[Node] = set()
        weight_set, cuts, kids = self.weight_set, self.cuts, self.children
        for node in self.input_set:
            opaque = isinstance(node, BackwardCFunction)
            for child, _ in kids[node]:
                if child in weight_set and child not in cuts:
                    if not opaque:
                        reruns.add(child)
                    entry = (node, child)
                    labels[child] = entry if labels.get(child, entry) == entry else _MULTI
        for node in cuts:
            labels[node] = _MULTI if node in labels else node
        for node in reversed(self.nodes):  # parents before children
            label = labels.get(node)
            if node not in weight_set or label is None:
                continue
            for child, _ in kids[node]:
                if child in weight_set:
                    labels[child] = label if labels.get(child, label) == label else _MULTI
        return {child for child in reruns if labels[child] is _MULTI}


def _opaque(node: Node) -> bool:
    """A Python ``autograd.Function``'s node: it computes all its input gradients at once (and a remote call's sends
    a message: it must run once), so the I pass keeps what it computed for its W edges."""
    return isinstance(node, BackwardCFunction)


def run_backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    wanted: Sequence[torch.Tensor] = (),
    *,
    retain_graph: bool = False,
) -> None:
    """One whole backward on this thread (``"interleaved"``, ``"simple"``); ``wanted`` is accumulated as any leaf."""
    del wanted
    with torch.autograd.set_multithreading_enabled(False):  # [Note: backward on the calling thread]
        torch.autograd.backward(list(roots), list(grads), retain_graph=retain_graph)


class WeightPasses:
    """The backwards of one step on one rank under ``"zero_bubble"``: the input pass now, the weight pass deferred
    and run by one thread in the order the passes were deferred.

    Each weight pass runs as its own task (``Phase.WEIGHT``, its backward's microbatch) holding the compute token,
    so the token's priorities place it (see [Note: zero-bubble]). Thread-safe.

    Args:
        core: the step's core (compute token, priorities, grant order, failure, threads).
    """

    def __init__(self, core: SessionCore) -> None:
        self.core = core
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Task, WeightPass]] = collections.deque()
        self._busy = False
        self._started = False
        self._stopped = False

    def backward(
        self,
        roots: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        wanted: Sequence[torch.Tensor] = (),
        *,
        retain_graph: bool = False,
    ) -> None:
        """The input pass of ``backward(roots, grads)`` now (``wanted``'s ``.grad`` complete after it), its weight pass
        deferred to after the current task (see :func:`split_backward`)."""
        with torch.autograd.set_multithreading_enabled(False):  # [Note: backward on the calling thread]
            weight_pass = split_backward(roots, grads, wanted, retain_graph=retain_graph)
        if weight_pass is None:
            return
        task = current_task()
        if task is None:  # not an engine task: nothing to overlap
            weight_pass.run()
            return
        weight = Task(task.microbatch, Phase.WEIGHT, task.label, ident=("w", *task.ident))
        with self._cv:
            if self._stopped:  # after the drain (a late request of a failed step): nothing to defer to
                self.core.raise_if_failed()
                raise PipelineError(f"a backward of {task.label!r} ran after this step's weight passes ended")
            self._queue.append((weight, weight_pass))
            start, self._started = not self._started, True
            self._cv.notify_all()
        if start:
            self.core.start_thread(self._loop, "smp-weights")

    def drain(self) -> None:
        """Wait until every deferred pass ran; then the thread ends.

        Raises:
            PipelineError: the step failed (here or on another stage) meanwhile.
        """
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait(POLL_S)
                self.core.raise_if_failed()
        self.stop()

    def stop(self) -> None:
        """Drop the passes not run yet (the step failed) and end the thread."""
        with self._cv:
            self._stopped = True
            self._queue.clear()
            self._cv.notify_all()

    def _loop(self) -> None:
        core = self.core
        core.enter_thread()
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                task, weight_pass = self._queue.popleft()
                self._busy = True
            try:
                with as_task(task), core.token.hold(core.priority(task), core.grant_key(task)):
                    weight_pass.run()
            except BaseException as err:
                core.fail(err)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
