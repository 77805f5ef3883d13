from examples.gpt_model import GPTConfig
from tests.dist_utils import mesh_1d, reference_and_copy, shard_gpt, train_pair

def parity(rank, ws, opt, kw):
    cfg = GPTConfig()
    ref, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), **kw)
    return train_pair(rank, ws, model, ref, cfg, optimizer=opt)

def parity_torch(rank, ws, opt, kw):
    from torch.distributed.fsdp import fully_shard
    cfg = GPTConfig()
    ref, model = reference_and_copy(cfg)
    for b in model.blocks: fully_shard(b, mesh=mesh_1d(ws), **kw)
    fully_shard(model, mesh=mesh_1d(ws), **kw)
    return train_pair(rank, ws, model, ref, cfg, optimizer=opt)

def parity_detail(rank, ws, opt, kw):
    import torch
    from tests.dist_utils import full_value
    cfg = GPTConfig()
    ref, model = reference_and_copy(cfg)
    shard_gpt(model, mesh_1d(ws), **kw)
    train_pair(rank, ws, model, ref, cfg, optimizer=opt, steps=1)
    r = dict(ref.named_parameters())
    return sorted(((full_value(p.detach()) - r[n].detach()).abs().max().item(), n) for n, p in model.named_parameters())[-3:]
