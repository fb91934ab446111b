from tests.factories import gloo_job

def job(rank, trace, ckpt, kw):
    from sdc_forensics.demo.sharded import train
    kw = dict(kw)
    world = kw.pop("world", 4)
    if kw.get("hsdp"): kw["hsdp"] = tuple(kw["hsdp"])
    kw["inject"] = tuple(kw.get("inject", ()))
    return train(rank, world, trace, ckpt, **kw)
