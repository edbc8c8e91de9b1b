#!/usr/bin/env python3
"""Write the seed corpora of the fuzzers: tests/fuzz/corpus/<target>/<name>.

Small valid and near-valid inputs of each format, so that the fuzzers start
from the structures peers really send (Mooncake descriptors, real frames).
The files are committed; run this again after changing a format:
    python3 tests/fuzz/seeds.py
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")

LE = lambda v: struct.pack("<Q", v & (2**64 - 1))
BE = lambda v: struct.pack(">Q", v & (2**64 - 1))


def write(target, seeds):
    d = os.path.join(CORPUS, target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for name, data in seeds.items():
        if isinstance(data, str):
            data = data.encode()
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


def st(header, data=b"", pad=True):
    h = header.encode() if isinstance(header, str) else header
    if pad:
        h += b" " * (-len(h) % 8)
    return LE(len(h)) + h + data


def st_tensor(dtype, shape, data, meta=None):
    hdr = {"tensor": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}}
    if meta is not None:
        hdr = {"__metadata__": meta, **hdr}
    return st(json.dumps(hdr, separators=(",", ":")), data)


def safetensors():
    none = struct.pack("<q", -150886311)
    return {
        "none_i64": st_tensor("I64", [1], none),
        "f32_2x3": st_tensor("F32", [2, 3], struct.pack("<6f", *range(6))),
        "bf16_kv": st_tensor("BF16", [2, 1, 2, 2], bytes(range(16))),
        "u8_scalar": st_tensor("U8", [], b"\x07"),
        "bool_empty": st_tensor("BOOL", [0, 4], b""),
        "f8_e4m3": st_tensor("F8_E4M3", [3], b"\x01\x02\x03"),
        "f64_meta": st_tensor("F64", [1], struct.pack("<d", 1.5), {"format": "pt"}),
        "unpadded": st('{"tensor":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}}', b"\x01\x02",
                       pad=False),
        "spaced": st('{ "tensor" : { "dtype" : "U16", "shape" : [ 1 ], "data_offsets" : [ 0 , 2 ] } }',
                     b"\x01\x02"),
        # Near-valid: each breaks one rule.
        "bad_len": st('{"tensor":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', b"\0" * 4),
        "bad_dtype": st('{"tensor":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
        "two_tensors": st('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                          '"tensor":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\0\0"),
        "neg_dim": st('{"tensor":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}'),
        "huge_dims": st('{"tensor":{"dtype":"F64","shape":[4294967296,4294967296],'
                        '"data_offsets":[0,0]}}'),
        "nul_name": st('{"tensor":{"dtype":"U8\\u0000","shape":[1],"data_offsets":[0,1]}}', b"\0"),
        "header_too_long": LE(1 << 40) + b"{}",
        "trailing": st('{"tensor":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}x', b"\0"),
    }


def hdr(size, addr, op):
    return LE(size) + LE(addr) + bytes([op]) + b"\0" * 7


def regions(*regs):
    out = bytes([len(regs)])
    for a, l in regs:
        out += LE(a) + LE(l)
    return out


def tcp_wire():
    ok = LE(0x4D435456 << 32)
    rej = LE(0x4D435456 << 32 | 1)
    base = regions((0x10000, 0x1000), (0x20000, 0x100))
    return {
        "read_v2": base + ok + hdr(0x100, 0x10000, 0x80),
        "write_v2": base + rej + hdr(0x1000, 0x10000, 0x81),
        "v1_pipelined": base + ok + hdr(8, 0x10ff8, 0) + hdr(8, 0x20000, 1) + hdr(0, 0, 0),
        "outside": base + ok + hdr(0x101, 0x20000, 0x80) + hdr(1, 0x11000, 0x81),
        "straddle": regions((0x1000, 0x1000), (0x2000, 0x1000)) + ok + hdr(0x10, 0x1ff8, 0x80),
        "wrap": regions((2**64 - 0x2000, 0x1000)) + ok + hdr(2**64 - 1, 0x10, 0x80),
        "bad_opcode": base + LE(0x12345678 << 32) + hdr(1, 0x10000, 0x82),
        "no_regions": regions() + ok + hdr(1, 0, 0),
        "overlapping_regions": regions((0x1000, 0x100), (0x1080, 0x100), (0x0, 0x1000)) + ok,
        # A length with its top bit set registers device memory: never served.
        "device_region": regions((0x10000, 0x1000 | 1 << 63), (0x20000, 0x100)) + ok
        + hdr(0x10, 0x10000, 0x80) + hdr(0x10, 0x20000, 0x80),
    }


def shm_wire():
    magic = 0x4B565348
    hello = LE(magic << 32 | 1) + LE(0x7fff0000) + LE(0x6b7670697065736d)
    status_ok = LE(magic << 32)
    status_range = LE(magic << 32 | 6)
    status_errno = LE(magic << 32 | 14 << 16 | 11)

    def req(remote, length, local, op):
        return LE(remote) + LE(length) + LE(local) + bytes([op]) + b"\0" * 7

    base = regions((0x10000, 0x1000))
    return {
        "hello_read": base + hello + status_ok + req(0x10000, 0x1000, 0x50000, 0),
        "hello_write": base + hello + status_range + req(0x10800, 0x800, 0x50000, 1),
        "window": base + hello + status_errno + b"".join(
            req(0x10000 + 0x100 * i, 0x100, 0x60000, i & 1) for i in range(8)),
        "outside": base + hello + status_ok + req(0x10fff, 2, 0, 0) + req(0, 0, 0, 0),
        "bad_hello": base + LE(magic << 32 | 2) + LE(0) + LE(0) + LE(magic << 32 | 15),
        "bad_opcode": base + hello + status_ok + req(0x10000, 1, 0, 2),
    }


def ucx_wire():
    magic = 0x5550564B
    w0 = lambda aux: LE(magic | aux << 32)
    addr = bytes(range(1, 41))  # a worker address
    kid, nonce, mac = b"K" * 8, b"N" * 32, b"M" * 32
    rkey = lambda a, n, key: LE(a) + LE(n) + LE(len(key)) + key + b"\0" * (-len(key) % 8)
    # The first byte: the kind (AM id - 1, low 3 bits), bit 3: the receiver has a key.
    return {
        "hello": b"\x00" + w0(1) + LE(7) + addr,
        "hello_auth": b"\x00" + w0(1 | 1 << 16) + LE(0) + kid + nonce + addr,
        "hello_ack": b"\x01" + w0(0 | 2 << 16) + LE(5) + LE(0x10000) + LE(0x1000)
        + LE(0x20000) + LE(0x100),
        "hello_ack_refused": b"\x01" + w0(1) + LE(0),
        "hello_ack_rkeys": b"\x09" + w0(0 | 1 << 16) + LE(3) + LE(0x10000) + LE(0x1000)
        + LE(2) + rkey(0x30000, 0x2000, b"rkey-bytes") + rkey(0x40000, 0x100, b"12345678"),
        "revoke": b"\x02" + w0(0) + LE(4) + LE(0x10000) + LE(0x1000),
        "revoke_ack": b"\x03" + w0(0) + LE(5) + LE(4),
        "bye": b"\x04" + w0(0) + LE(5),
        "challenge": b"\x05" + w0(0) + LE(9) + nonce + mac,
        "proof": b"\x06" + w0(0) + LE(9) + mac,
    }


def frame(type_, text, length=None):
    body = text.encode()
    return LE(len(body) + 1 if length is None else length) + bytes([type_]) + body


def mooncake_desc(name="127.0.0.1:17100", port=15432, bufs=((0x7f0000000000, 1 << 20),)):
    return {
        "name": name,
        "protocol": "tcp",
        "tcp_data_port": port,
        "timestamp": "2025-01-01 00:00:00",
        "buffers": [{"name": "cpu:0", "addr": a, "length": l} for a, l in bufs],
        "devices": [],
        "priority_matrix": {},
    }


def kvpipe_desc():
    d = mooncake_desc(bufs=((140000000000000, 4096), (140000000004096, 8192)))
    d["tcp_proto_version"] = 2
    d["kvpipe_shm"] = {"version": 1, "host_id": "boot/pid:1/net:2", "pid": 1234,
                       "socket": "kvpipe-shm/1234/00112233aabbccdd"}
    return d


def j(o):
    return json.dumps(o, separators=(",", ":"))


def descriptor():
    rdma = {
        "name": "10.0.0.2:12345", "protocol": "rdma",
        "devices": [{"name": "mlx5_0", "lid": 0, "gid": "fe80::1"}],
        "buffers": [{"name": "cpu:0", "addr": 4096, "length": 4096, "rkey": [1], "lkey": [2]}],
        "priority_matrix": {"cpu:0": [["mlx5_0"], []]},
    }
    return {
        "mooncake_tcp": j(mooncake_desc()),
        "mooncake_v2_many": j({**mooncake_desc(bufs=[(4096 * i, 4096) for i in range(1, 9)]),
                               "tcp_proto_version": 2}),
        "kvpipe_shm": json.dumps(kvpipe_desc(), indent=2),
        "no_buffers": j({**mooncake_desc(), "buffers": []}),
        "mooncake_rdma": j(rdma),
        "overlap": j(mooncake_desc(bufs=((4096, 8192), (8192, 4096)))),
        "unsorted": j(mooncake_desc(bufs=((65536, 16), (4096, 16), (32768, 16)))),
        "max_exact": j(mooncake_desc(bufs=((9007199254740991, 9007199254740991),))),
        "float_addr": '{"name":"a","protocol":"tcp","tcp_data_port":1,"buffers":[{"addr":1.5,"length":1}]}',
        "port_zero": j(mooncake_desc(port=0)),
        "string_port": '{"name":"a","protocol":"tcp","tcp_data_port":"15432","buffers":[]}',
        "exp_number": '{"name":"a","protocol":"tcp","tcp_data_port":1e3,"tcp_proto_version":1e9,"buffers":[{"addr":1e15,"length":2e0}]}',
    }


def p2p():
    return {
        "metadata_mooncake": frame(1, j(mooncake_desc())),
        "metadata_kvpipe": frame(1, j(kvpipe_desc())),
        "connect": frame(0, "{}"),
        "notify": frame(2, '{"name":"seg","notify_msg":"hello"}'),
        "probe": frame(3, ""),
        "type_4": frame(4, "{}"),
        "too_long": LE((1 << 20) + 1) + b"\x01{}",
        "zero_length": LE(0) + b"\x01",
        "short_body": frame(1, '{"name":"x"}', length=100),
    }


def rpc_meta():
    return {
        "mooncake": '{"ip_or_host_name":"10.0.0.2","rpc_port":12345}',
        "kvpipe": '{"ip_or_host_name":"127.0.0.1","rpc_port":17100}',
        "ipv6": '{"ip_or_host_name":"::1","rpc_port":0}',
        "hostname": '{ "rpc_port" : 65535 , "ip_or_host_name" : "prefill-0.cluster.local" , "x" : [1] }',
        "port_high": '{"ip_or_host_name":"h","rpc_port":65536}',
        "port_float": '{"ip_or_host_name":"h","rpc_port":80.5}',
        "empty_host": '{"ip_or_host_name":"","rpc_port":80}',
        "long_host": j({"ip_or_host_name": "a" * 300, "rpc_port": 80}),
        "not_object": '["ip_or_host_name","rpc_port"]',
    }


def config():
    vllm = {
        "prefill_url": "192.168.0.137:13003",
        "decode_url": "192.168.0.139:13003",
        "metadata_server": "192.168.0.139:2379",
        "metadata_backend": "etcd",
        "protocol": "tcp",
        "device_name": "",
    }
    return {
        "vllm_etcd": json.dumps(vllm, indent=4),
        "redis": j({**vllm, "metadata_server": "redis://10.0.0.1:6379", "metadata_backend": "Redis"}),
        "http": j({**vllm, "metadata_server": "http://127.0.0.1:8080/metadata", "metadata_backend": None}),
        "p2p_same_url": j({"prefill_url": "127.0.0.1:17100", "decode_url": "127.0.0.1:17100",
                           "metadata_server": "P2PHANDSHAKE"}),
        "ipv6": j({**vllm, "prefill_url": "[::1]:14000", "decode_url": "[fe80::2]:14000"}),
        "rdma": j({**vllm, "protocol": "rdma", "device_name": "mlx5_0,mlx5_1"}),
        "shm": j({**vllm, "protocol": "shm"}),
        "high_port": j({**vllm, "prefill_url": "h:65530", "decode_url": "h:65520"}),
        "missing_decode": j({k: v for k, v in vllm.items() if k != "decode_url"}),
        "bad_backend": j({**vllm, "metadata_backend": "consul"}),
        "port_type": '{"prefill_url":13003,"decode_url":"a:1","metadata_server":"x"}',
        "no_port": j({**vllm, "prefill_url": "192.168.0.137"}),
        # Found by fuzz_config: host "[e02" would be written as "[e02:14000".
        "bracket_in_host": j({**vllm, "decode_url": "[[e02]:14000"}),
    }


def pipe_announce():
    def msg(max_bytes, *frames):
        out = LE(max_bytes)
        for f in frames:
            out += bytes([len(f)]) + f
        return out

    default_max = 32 << 30
    return {
        "announce": msg(default_max, BE(0x7f1234560000), BE(1 << 20)),
        "small": msg(4096, BE(0x1000), BE(4096)),
        "too_big": msg(4096, BE(0x1000), BE(4097)),
        "zero": msg(default_max, BE(0x1000), BE(0)),
        "wrap": msg(2**64 - 1, BE(2**64 - 16), BE(32)),
        "one_frame": msg(default_max, BE(0x1000)),
        "three_frames": msg(default_max, BE(0x1000), BE(8), b"ACK"),
        "short_frame": msg(default_max, b"\x01\x02\x03\x04", BE(8)),
        "ack_on_data": msg(default_max, b"ACK"),
        "ack_lower": msg(default_max, b"ack"),
        "ack_long": msg(default_max, b"ACKS"),
        "ack_two_frames": msg(default_max, b"ACK", b"ACK"),
        "inline": msg(default_max, b"KVPINL01" + LE(8) + b'{"a":1} '),
        "inline_short": msg(default_max, b"KVPINL01" + LE(8) + b"{}"),
        "inline_two_frames": msg(default_max, b"KVPINL01" + LE(8) + b'{"a":1} ', BE(8)),
    }


def http_store():
    # Odd first byte: ops of u8 kind, u8 key length, key, u16 LE value length, value.
    kinds = {"get": 0, "put": 1, "delete": 2, "post": 3, "chunked": 4, "no_key": 5,
             "too_large": 6, "head": 7, "pipelined": 8, "list": 9}

    def ops(*items):
        out = b"\x01"
        for kind, key, value in items:
            key = key if isinstance(key, bytes) else key.encode()
            value = value.encode()
            out += bytes([kinds[kind], len(key)]) + key + struct.pack("<H", len(value)) + value
        return out

    desc = j(mooncake_desc())

    def req(method, url, headers="", body=""):
        # Even first byte: method NUL url NUL header lines NUL body.
        return b"\x00" + f"{method}\0{url}\0{headers}\0{body}".encode()

    return {
        "ops_put_get_delete": ops(("put", "mooncake/ram/a", desc), ("get", "mooncake/ram/a", ""),
                                  ("delete", "mooncake/ram/a", ""), ("get", "mooncake/ram/a", "")),
        "ops_rpc_meta": ops(("put", "mooncake/rpc_meta/a", '{"ip_or_host_name":"h","rpc_port":1}'),
                            ("put", "mooncake/rpc_meta/a", "{}"), ("get", "mooncake/rpc_meta/a", "")),
        "ops_chunked": ops(("chunked", "k", "0123456789abcdef" * 4), ("get", "k", "")),
        "ops_pipelined": ops(("pipelined", "k", desc), ("get", "k", "")),
        "ops_refused": ops(("post", "k", "x"), ("no_key", "", ""), ("too_large", "k", ""),
                           ("head", "k", "")),
        "ops_rpc_meta_twice": ops(("put", "mooncake/rpc_meta/h:1", "{}"),
                                  ("pipelined", "mooncake/rpc_meta/h:1", "x"),
                                  ("delete", "mooncake/rpc_meta/h:1", ""),
                                  ("delete", "mooncake/rpc_meta/h:1", ""),
                                  ("put", "mooncake/rpc_meta/h:1", "y"), ("list", "", "")),
        "ops_list": ops(("put", "mooncake/ram/b", "1"), ("put", "mooncake/ram/a", "2"),
                        ("put", b"\xff\x01", "3"), ("list", "", ""), ("delete", "mooncake/ram/a", ""),
                        ("list", "", "")),
        "ops_odd_keys": ops(("put", "a b/c?d&e=f%", "v"), ("get", "a b/c?d&e=f%", ""),
                            ("put", "x\0y", "nul"), ("get", "x", ""), ("put", "", "empty")),
        "req_get": req("GET", "/metadata?key=mooncake/ram/127.0.0.1:17100"),
        "req_put": req("PUT", "/metadata?key=mooncake%2Fram%2Fa", "Content-Type: application/json", desc),
        "req_delete": req("DELETE", "/?key=a&key=b"),
        "req_options": req("OPTIONS", "*"),
        "req_bad_escape": req("GET", "/metadata?key=%zz%"),
        "req_bare_key": req("PUT", "/metadata?key", "X-A: 1\nX-B: 2", "v"),
        "req_empty_key": req("GET", "/metadata?key=&other=1"),
        "req_nul_key": req("PUT", "/metadata?key=%00abc", "", "v"),
        "req_plus": req("GET", "/metadata?key=a+b"),
        "req_bad_header": req("GET", "/metadata?key=a", "NoColonHere"),
        "req_lower_method": req("get", "/metadata?key=a"),
        "req_absolute_url": req("GET", "http://h:1/metadata?key=a"),
    }


def main():
    write("safetensors", safetensors())
    write("tcp_wire", tcp_wire())
    write("shm_wire", shm_wire())
    write("ucx_wire", ucx_wire())
    write("descriptor", descriptor())
    write("p2p", p2p())
    write("rpc_meta", rpc_meta())
    write("config", config())
    write("pipe_announce", pipe_announce())
    write("http_store", http_store())


if __name__ == "__main__":
    main()
