"""gcp-storage-emulator with its multipart upload parser made byte-exact and two costs that grew with the number of
objects removed (both below); run as a script with the emulator's own
arguments (`python gcs_emulator.py start --host ... --port ... --in-memory`).

Why: gcsfs sends an object under 5 MiB as one multipart/related request whose lines, part delimiters included,
end in a bare LF (`--==0==\n...\n\n<content>\n--==0==--`). The emulator parses it with Python's `email` parser,
which takes a CR before that LF for a CRLF line ending and drops it: an object whose last byte is a carriage return
was stored one byte short (measured: 2 of 200 random objects, those ending in b"\r"). Checkpoint files end in any
byte, so a restore from the emulator failed now and then with "Error decoding local file". This parser reads the
line ending from the request's first delimiter line and takes each part's content up to exactly that line ending
before the next delimiter (RFC 2046 section 5.1.1: it belongs to the delimiter), so no content byte is lost.
msjax itself asks gcsfs to check the MD5 of every write (msjax.paths), which turns the emulator's loss into a failed
upload; tests/msjax/test_storage.py shows both.
"""

import json
import re
import sys

from gcp_storage_emulator import server, storage
from gcp_storage_emulator.__main__ import main

_emulator_read_data = server._read_data


def _multipart_parts(body: bytes, boundary: bytes) -> list[tuple[dict[str, str], bytes]]:
    """(headers with lower-case names, content bytes) of each part of a multipart body."""
    delimiter = b"--" + boundary
    first = body[body.index(delimiter) + len(delimiter):]
    eol = b"\r\n" if first.startswith(b"\r\n") else b"\n"
    parts = []
    for chunk in (eol + body).split(eol + delimiter)[1:]:  # the first delimiter may open the body
        if chunk.startswith(b"--"):  # the close delimiter
            break
        head, _, content = chunk.removeprefix(eol).partition(eol + eol)
        headers = dict(line.split(":", 1) for line in head.decode("latin-1").split(eol.decode()) if ":" in line)
        parts.append(({k.strip().lower(): v.strip() for k, v in headers.items()}, content))
    return parts


def _read_data(request_handler, query):
    content_type = request_handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _emulator_read_data(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not raw or match is None:
        return None
    (_, meta), (headers, content) = _multipart_parts(raw, match.group(1).encode("latin-1"))[:2]
    return {"meta": json.loads(meta), "content": content,
            "content-type": headers.get("content-type", "application/octet-stream").split(";")[0]}


server._read_data = _read_data

# The emulator serves one request at a time from socketserver's listen backlog, 5 connections by default; gcsfs
# opens many at once (a checkpoint's files are uploaded and downloaded concurrently), and connections beyond the
# backlog waited for TCP's SYN retransmission: 50 small objects read concurrently took 0.31 s each against 2 ms
# one at a time (measured here). A deeper backlog lets them queue instead.
server.server.HTTPServer.request_queue_size = 1024

# Every write re-serialises the metadata of every object into one JSON file (`Storage._write_config_to_file`), which
# in memory is read only when the server starts: each request grew with the bucket (8.8 ms per small object at 200
# objects, measured), and checkpoints written as a file per chunk put thousands there. In memory it is skipped.
_write_config_to_file = storage.Storage._write_config_to_file


def _write_config_unless_in_memory(self):
    if not self._use_memory_fs:
        _write_config_to_file(self)


storage.Storage._write_config_to_file = _write_config_unless_in_memory

if __name__ == "__main__":
    main(sys.argv[1:])
