"""Checkpoint composes with DDP and FSDP2 (single-process gloo group on CPU)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import fastckpt


@pytest.fixture(scope="module")
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU())
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        if self.use_reentrant is not None:
            x = fastckpt.checkpoint(self.a, x, use_reentrant=self.use_reentrant)
        else:
            x = self.a(x)
        return self.b(x)


def reference_grads(x):
    torch.manual_seed(0)
    net = Net(None)
    net(x).pow(2).sum().backward()
    return [p.grad for p in net.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_ddp(process_group, use_reentrant):
    x = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(use_reentrant))
    model(x).pow(2).sum().backward()
    for got, expected in zip([p.grad for p in model.parameters()], reference_grads(x), strict=True):
        assert torch.equal(got, expected)


def test_fsdp2(process_group):
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    x = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(0)
    model = Net(False)
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(x).pow(2).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    for got, expected in zip(grads, reference_grads(x), strict=True):
        assert torch.equal(got, expected)
