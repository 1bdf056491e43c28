"""Runs gcp-storage-emulator on 127.0.0.1, with the one header real GCS sends and it omits.

  python -m tests.gcs_emulator --port=P --bucket=B

Real GCS answers every media download with `x-goog-generation`; TensorStore reads an object's
generation from it and rejects a read without it ("Malformed StorageGeneration"). The emulator
(2026.7.19) leaves it out, so this wrapper adds it to the emulator's own download handler and
otherwise runs the emulator unchanged (in memory).
"""

import argparse

from gcp_storage_emulator import server
from gcp_storage_emulator.handlers import objects

_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the emulator already answered 404
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args()
    objects.download = _download_with_generation  # objects.get(alt=media) calls it by name
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            if handler is _download:
                handlers[method] = _download_with_generation
    server.create_server("127.0.0.1", args.port, in_memory=True, default_bucket=args.bucket).run()


if __name__ == "__main__":
    main()
