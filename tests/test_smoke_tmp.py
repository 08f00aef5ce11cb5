import asyncio
from conftest import auth, base_config

async def test_burst(fakegpus, gateway, http):
    g = await fakegpus(steps=3, step_ms=20)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=2, max_queue_depth=100))
    async def one(i):
        async with http.post(gw.url + "/gen/generate", json={"echo": i}, headers=auth()) as r:
            return r.status, await r.json(), dict(r.headers)
    res = await asyncio.gather(*[one(i) for i in range(50)])
    print(res[0])
    assert all(s == 200 for s, _, _ in res), [s for s,_,_ in res]
    st = g.stats
    print(st)
    assert st["max_concurrent"] <= 2 and st["oom_count"] == 0
