"""SGLang's own source, read as data: the contract our client, chart and CPU engine are held to.

SGLang cannot run here (CUDA-only dependencies), but its wheels are pure Python. `source` pins the
versions and fetches their wheels (`pip download --no-deps`, never installed, never imported);
`facts` reads route tables, request structures, response keys and server flags out of the wheel
with `ast`; `contract` lists what the stack uses and checks it against those facts.
"""
