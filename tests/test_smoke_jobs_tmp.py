import asyncio, orjson
from conftest import auth, base_config

async def read_sse(resp):
    evs=[]; cur={}
    async for line in resp.content:
        line=line.decode().rstrip("\n")
        if not line:
            if cur: evs.append(cur); cur={}
            continue
        k,_,v=line.partition(": ")
        cur[k]=v
    return evs

async def test_sse(fakegpus, gateway, http):
    g = await fakegpus(steps=3, step_ms=50)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    async def one(i):
        async with http.post(gw.url + "/gen/generate", json={"echo": i}, headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
            assert r.status == 200, await r.text()
            return await read_sse(r)
    res = await asyncio.gather(*[one(i) for i in range(4)])
    for e in res[3]: print(e)
    async with http.post(gw.url + "/gen/generate", json={"echo": 9}, headers={**auth(), "Prefer": "respond-async"}) as r:
        print(r.status, await r.json(), r.headers.get("Location"))
        loc = r.headers["Location"]
    await asyncio.sleep(0.5)
    async with http.get(gw.url + loc, headers=auth()) as r:
        print(await r.json())
    async with http.get(gw.url + loc + "/result", headers=auth()) as r:
        print(r.status, await r.text())
