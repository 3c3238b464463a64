#!/usr/bin/env python3
"""Splits a single-file safetensors checkpoint into N shards with a
model.safetensors.index.json, the way sharded hub checkpoints are laid out.
usage: shard_checkpoint.py SRC_DIR DST_DIR N"""
import json
import os
import shutil
import struct
import sys


def main():
    src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        hlen = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(hlen))
        data = f.read()
    header.pop("__metadata__", None)
    names = sorted(header)
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    weight_map = {}
    for s in range(n):
        part = names[s::n]
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        out_header, blobs, off = {}, [], 0
        for name in part:
            t = header[name]
            b, e = t["data_offsets"]
            out_header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [off, off + e - b]}
            blobs.append(data[b:e])
            off += e - b
            weight_map[name] = fname
        h = json.dumps(out_header).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(dst, fname), "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": len(data)}, "weight_map": weight_map}, f)


if __name__ == "__main__":
    main()
