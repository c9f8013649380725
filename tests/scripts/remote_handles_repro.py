"""Reproductions of the open defects of ``remote_handles=True`` (experimental, off by default), from a review.

Run by hand (not collected by pytest, not run by CI), from the repository root:

    PYTHONPATH=. python tests/scripts/remote_handles_repro.py <scenario> 1|0 [timeout_s]

``1`` runs with remote handles, ``0`` with ``remote_handles=False`` (the control); each scenario runs the same step
at pp=1 and pp=2 and prints both losses and the parameters whose gradients differ. Scenarios that showed a defect
with handles (and none without): ``order`` (a dropout module called twice in one microbatch, the first call behind a
reference to a slow producer: its calls run out of order on the owner, the masks differ from pp=1), ``bn`` (the same
with BatchNorm: running statistics differ), ``inplace_get`` (a fetch not ordered after an earlier call that changes
the fetched output in place), ``sibling_whole`` (``t[0]`` fetched and changed in place, then ``t`` sent back by
reference: the owner uses the unchanged value), ``discard`` with ``SCHED=simple`` (a discarded call referencing an
output the owner already freed waits for the timeout). ``function``, ``ac``, ``ckpt_*_arg``: a handle passed to a
custom ``autograd.Function`` / ``torch.utils.checkpoint`` / a checkpointed local module (a segfault before handles
stopped claiming to be tensors; now ``function`` runs, but no gradient flows back through the handle: the upstream
parameters' gradients differ from pp=1). ``probe``, ``twice``, ``cat``, ``ckpt_remote`` worked. ``--stale``
instead of a scenario: a handle kept from step 0 and passed back in step 1 waits for the timeout.
"""
import sys, time
import torch, torch.nn.functional as F
from torch import nn
from lightning_mp.pipeline import PipelineEngine, split_microbatches
from tests._dist import make_transport, run_distributed
from tests.models import expand_placement

DIM = 8

class DBlock(nn.Module):
    def __init__(self, p=0.5, dim=DIM):
        super().__init__()
        self.fc = nn.Linear(dim, dim); self.drop = nn.Dropout(p)
    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))

class Slow(nn.Module):
    def __init__(self, dim=DIM, secs=0.0):
        super().__init__(); self.fc = nn.Linear(dim, dim); self.secs = secs
    def forward(self, x):
        if self.secs: time.sleep(self.secs)
        return self.fc(x)

class Two(nn.Module):
    def __init__(self):
        super().__init__(); self.fc = nn.Linear(DIM, DIM)
    def forward(self, x, y):
        return self.fc(x) + y

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.a = Slow(secs=0.3)
        self.b = DBlock()
        self.two = Two()
        self.out = nn.Linear(DIM, 1)
        self.tup = TupleOut()

class TupleOut(nn.Module):
    def __init__(self):
        super().__init__(); self.fc = nn.Linear(DIM, DIM)
    def forward(self, x):
        y = self.fc(x)
        return (y, y * 2)

# --- scenario steps -----------------------------------------------------------------------------------------
def step_order(m, x):
    """dropout module b called twice in one microbatch; the 1st call waits for a slow ref, the 2nd is independent."""
    h = m.inp(x)
    a = m.a(h)          # stage 1, slow
    b1 = m.b(a)         # stage 1, by reference to a: waits for a
    b2 = m.b(h)         # stage 1, data: ready at once
    return (m.out(b1) * 1.0 + m.out(b2) * 3.0).sum()

def step_sibling(m, x):
    """a child of a tuple output is fetched and changed in place; then the whole tuple goes back to stage 1."""
    h = m.inp(x)
    t = m.tup(h)        # stage 1: (y, 2y)
    t[0].mul_(0.0)      # fetches t[0], zeroes it (eager: zeroes y inside t)
    z = m.two(t[0], t[1]) if False else m.two(*[t[0], t[1]])
    w = m.two(t, None) if False else None
    return m.out(z).sum()

def step_sibling_whole(m, x):
    h = m.inp(x)
    t = m.tup(h)
    t[0].mul_(0.0)
    z = m.b2(t)          # whole tuple by reference
    return m.out(z).sum()

def step_discard(m, x):
    """a slow call holds stage 1's token; a discarded call refs an earlier output; the loss needs only `a0`."""
    h = m.inp(x)
    a0 = m.b(h)          # stage 1 (dropout p=0 set below)
    s = m.a(h)           # stage 1, slow, discarded
    s2 = m.a(h)          # stage 1, slow again, discarded: keeps the token busy after a0's backward
    _ = m.two(a0, s)     # stage 1, refs a0 and s, discarded
    return m.out(a0).sum()

class TupSum(nn.Module):
    def __init__(self):
        super().__init__(); self.fc = nn.Linear(DIM, DIM)
    def forward(self, t):
        return self.fc(t[0] + t[1])

def step_twice(m, x):
    h = m.inp(x)
    a = m.a(h)
    c1 = m.two(a, a)        # a by reference, twice
    c2 = m.two(a, h)
    return (m.out(c1) + m.out(c2) + 2 * m.out(a)).sum()

def step_ckpt_remote(m, x):
    import torch.utils.checkpoint as cp
    h = m.inp(x)
    y = cp.checkpoint(lambda t: m.a(t) * 1.0, h, use_reentrant=False)
    return m.out(y).sum()

def step_ckpt_reentrant_arg(m, x):
    import torch.utils.checkpoint as cp
    h = m.inp(x)
    a = m.a(h)
    y = cp.checkpoint(lambda t: torch.tanh(m.out2(t)), a, use_reentrant=True)
    return m.out(y).sum()

def step_ckpt_nonreentrant_arg(m, x):
    import torch.utils.checkpoint as cp
    h = m.inp(x)
    a = m.a(h)
    y = cp.checkpoint(lambda t: torch.tanh(m.out2(t)), a, use_reentrant=False)
    return m.out(y).sum()

def step_probe(m, x):
    h = m.inp(x)
    a = m.a(h)
    import pickle, torchmetrics
    print("P0", flush=True)
    info = {"type_is": type(a) is torch.Tensor, "is_tensor": torch.is_tensor(a), "isinstance": isinstance(a, torch.Tensor)}
    print("P1", info, flush=True)
    b = m.a(h)
    try:
        b.requires_grad = False   # on a tensor: error for a non-leaf
        info["set_requires_grad"] = ("accepted", b.requires_grad, b.__dict__.get("requires_grad"))
    except RuntimeError as e:
        info["set_requires_grad"] = "raised"
    print("P2", info, flush=True)
    metric = torchmetrics.MeanSquaredError(sync_on_compute=False)
    metric.update(m.a(h), torch.zeros(4, DIM))
    info["metric"] = float(metric.compute())
    print("P3", info, flush=True)
    info["pickle"] = type(pickle.loads(pickle.dumps(m.a(h)))).__name__
    print("P4", info, flush=True)
    d = {m.a(h): 1}
    info["dictkey"] = len(d)
    print("PROBE", info, flush=True)
    return m.out(a).sum()

class Sq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t * t
    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return 2 * t * g

def step_function(m, x):
    h = m.inp(x)
    a = m.a(h)
    return m.out(Sq.apply(a)).sum()

def step_cat(m, x):
    h = m.inp(x)
    a = m.a(h)
    return m.out(torch.cat([a, h], 0)).sum() + m.out(torch.stack([a, h]).sum(0)).sum()

def step_ac(m, x):
    h = m.inp(x)
    a = m.a(h)                      # stage 1: a handle
    return m.out(torch.tanh(m.out2(a))).sum()   # out2: local, under set_activation_checkpointing

class BNBlock(nn.Module):
    def __init__(self):
        super().__init__(); self.fc = nn.Linear(DIM, DIM); self.bn = nn.BatchNorm1d(DIM, momentum=0.5)
    def forward(self, x):
        return self.bn(self.fc(x))

def step_bn(m, x):
    h = m.inp(x)
    a = m.a(h)            # stage 1
    b1 = m.bnb(a)         # by reference: waits for a
    b2 = m.bnb(h * 5.0)   # data: ready at once
    return (m.out(b1) + m.out(b2)).sum()

class InplaceHead(nn.Module):
    def __init__(self):
        super().__init__(); self.fc = nn.Linear(DIM, DIM)
    def forward(self, x):
        x.relu_()             # in place on its input (the output of a Linear: allowed by autograd)
        return self.fc(x)

def step_inplace_get(m, x):
    h = m.inp(x)
    a = m.a(h)            # stage 1, slow Linear
    b = m.inh(a)          # stage 1, by reference: ReLUs `a` in place (eager: the caller's `a` is changed too)
    s = m.a(h)            # stage 1, data: runs before `b` (F2), keeps the token
    return (m.out(a) + m.out(b)).sum()   # fetching `a` (first) is not ordered after `b`

STEPS = {"inplace_get": step_inplace_get, "bn": step_bn, "ac": step_ac, "function": step_function, "cat": step_cat, "twice": step_twice, "ckpt_remote": step_ckpt_remote, "ckpt_reentrant_arg": step_ckpt_reentrant_arg,
         "ckpt_nonreentrant_arg": step_ckpt_nonreentrant_arg, "probe": step_probe, "order": step_order, "sibling_whole": step_sibling_whole, "discard": step_discard}

def make(name):
    torch.manual_seed(0)
    m = M()
    m.b2 = TupSum()
    m.out2 = nn.Linear(DIM, DIM)
    m.bnb = BNBlock()
    m.inh = InplaceHead()
    if name == 'ac':
        from lightning_mp.memory._checkpointing import set_activation_checkpointing
        set_activation_checkpointing(m.out2)
    m.a.secs = 0.3 if name in ('discard', 'order', 'bn', 'inplace_get') else 0.0
    if name == "discard":
        m.b.drop.p = 0.0
    return m

PLACE = {"inh": 1, "bnb": 1, "a": 1, "b": 1, "two": 1, "tup": 1, "b2": 1}

def one_process(name, mbs=1, seed=0):
    from lightning_mp.pipeline._rng import MicrobatchRNG
    m = make(name)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    # single-stage engine gives the same RNG streams as any layout
    return None

def worker(rank, world, name, handles, timeout):
    import faulthandler; faulthandler.enable(); None
    torch.set_num_threads(1)
    m = make(name)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=timeout, remote_handles=handles, schedule=__import__("os").environ.get("SCHED","interleaved"),
                            seed=123)
    engine.install(m, expand_placement(m, PLACE if world > 1 else {}))
    t0 = time.monotonic()
    res = {}
    try:
        with engine.session() as session:
            if engine.is_driver:
                outs = session.drive(lambda mb, i: STEPS[name](m, mb), [x], loss_fn=lambda l: l, backward=True)
                session.finish(None)
                res["loss"] = float(outs[0])
            else:
                session.serve()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res["secs"] = round(time.monotonic() - t0, 1)
    res["bn_mean"] = m.bnb.bn.running_mean.clone() if m.bnb.bn.running_mean is not None else None
    res["grads"] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return res

def _stale() -> None:
    for r, l in enumerate(run_distributed(stale_worker, 2, 10.0)):
        print(r, l)


def stale_worker(rank, world, timeout):
    torch.set_num_threads(1)
    m = make("stale")
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=timeout, remote_handles=True)
    engine.install(m, expand_placement(m, PLACE))
    kept, log = [], []
    for step in range(2):
        t0 = time.monotonic()
        try:
            with torch.no_grad(), engine.session() as session:
                if engine.is_driver:
                    def fn(mb, i):
                        h = m.inp(mb)
                        a = m.a(h)
                        if step == 0:
                            kept.append(m.a(h))       # untouched; e.g. a memory/cache kept on the module for the next step
                            return m.out(a).sum()
                        return m.out(m.two(kept[0], h)).sum()   # last step's handle, by reference
                    session.drive(fn, [x], loss_fn=lambda l: None, backward=False)
                    session.finish(None)
                else:
                    session.serve()
            log.append((step, "ok", round(time.monotonic() - t0, 1)))
        except Exception as e:
            log.append((step, f"{type(e).__name__}: {str(e)[:160]}", round(time.monotonic() - t0, 1)))
    return log


if __name__ == "__main__":
    if sys.argv[1] == "--stale":
        _stale()
        sys.exit()
    name, handles = sys.argv[1], sys.argv[2] == "1"
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 20
    one = run_distributed(worker, 1, name, handles, timeout)[0]
    two = run_distributed(worker, 2, name, handles, timeout)
    print(name, "handles" if handles else "eager")
    print(" pp=1:", one.get("loss"), one.get("error"), one["secs"])
    print(" pp=2:", two[0].get("loss"), two[0].get("error"), two[0]["secs"], "| stage1:", two[1].get("error"), two[1]["secs"])
    g2 = {**two[0]["grads"], **two[1]["grads"]}
    bad = [n for n in one["grads"] if n not in g2 or not torch.allclose(one["grads"][n], g2[n], atol=1e-6)]
    print(" grads differing:", bad)
    if name == "bn": print(" running_mean pp1", one["bn_mean"][:3], "pp2 stage1", two[1]["bn_mean"][:3])
