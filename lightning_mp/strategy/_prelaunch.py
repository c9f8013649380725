"""Layout checks in the launching process, before any other process starts.

A layout error found after the launch is reported by every rank, while the ranks already started go on until
they time out. What is known before the launch (the world size against ``pp x tp``, a saved plan's stages, the
training batch size, when known, against ``microbatches``) is therefore checked here, once. Evaluation batches
that do not split run as one microbatch (with a warning at the step), so only ``fit`` checks the batch size.
What needs the model or its data (a batch that does not split, a plan for another model) is checked at setup.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch.utils.data import DataLoader

from lightning_mp.config import SMPConfig
from lightning_mp.strategy._fsdp import check_fsdp_api
from lightning_mp.strategy._placement import read_plan
from lightning_mp.topology import Topology

__all__ = ["check_before_launch"]

_BATCH_SIZE_OWNERS = ("datamodule", "model")  # a `batch_size` attribute, as Lightning's batch-size finder reads


def check_before_launch(
    config: SMPConfig, world_size: int, function: Callable, args: tuple, kwargs: dict
) -> None:
    """Raise what the layout makes certain to fail, before ``function`` (a ``Trainer`` entry) starts any process.

    Args:
        config: the strategy's configuration.
        world_size: ``devices x num_nodes``.
        function: the ``Trainer`` entry point (``_fit_impl``, ...), called with ``args`` and ``kwargs``.

    Raises:
        ValueError: if ``world_size`` is not a multiple of ``pipeline_parallel_degree x tensor_parallel_degree``
            (or its data-parallel degree of ``sharded_data_parallel_degree``),
            the batch size known now does not divide into ``microbatches``, or ``partition_plan`` is unreadable or
            has another number of stages.
        FileNotFoundError: if ``partition_plan`` holds no plan.
        ValueError: under ``sharded_data_parallel_degree > 1``, if this torch lacks the FSDP2 internals it drives
            (``_fsdp.check_fsdp_api``).
    """
    Topology(
        world_size, 0, config.pipeline_parallel_degree, config.tensor_parallel_degree, config.placement_strategy,
        config.sharded_data_parallel_degree,
    )
    if config.sharded_data_parallel_degree > 1:
        check_fsdp_api()
    known = _known_batch_size(function, args, kwargs)
    if known is not None and known[1] % config.microbatches:
        where, size = known
        raise ValueError(
            f"The batch size of {where} is {size}, which does not split into microbatches={config.microbatches}."
            f" Use a batch size that is a multiple of {config.microbatches}, or microbatches that divide {size}."
        )
    if config.partition_plan is not None and config.pipeline_parallel_degree > 1:
        read_plan(config.partition_plan, config.pipeline_parallel_degree)


def _known_batch_size(function: Callable, args: tuple, kwargs: dict) -> tuple[str, int] | None:
    """``(where, size)`` of a training batch: the ``batch_size`` of a DataLoader given to ``fit``, else a
    ``batch_size`` attribute of the datamodule or the LightningModule (an int), else ``None`` (also for entry
    points other than ``fit``)."""
    signature = inspect.signature(function)
    if "train_dataloaders" not in signature.parameters:
        return None
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    loader = arguments.get("train_dataloaders")
    if isinstance(loader, DataLoader) and isinstance(loader.batch_size, int):
        return "the DataLoader given to `fit`", loader.batch_size
    for name in _BATCH_SIZE_OWNERS:
        size = getattr(arguments.get(name), "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return f"the {name} (its `batch_size`)", size
    return None
