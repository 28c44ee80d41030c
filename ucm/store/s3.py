"""``s3`` tier: blocks as objects in one bucket of an S3-compatible service (AWS S3, MinIO, Ceph
RGW, ...), through boto3.

Layout: ``<store.s3.prefix>/<namespace>/<id>.v`` (value: block header + payload) and ``.m``
(commit marker), in the bucket ``store.s3.bucket`` at ``store.s3.endpoint_url`` (empty: AWS).
The bucket must exist: the tier never creates one. Credentials and, unless
``store.s3.region`` is set, the region come from the usual AWS chain (environment, ``~/.aws``,
instance or container role): the configuration never holds secrets. The credentials need
``s3:GetObject``, ``s3:PutObject``, ``s3:DeleteObject``, ``s3:ListBucket`` and
``s3:AbortMultipartUpload`` under the prefix (without ``s3:ListBucket`` S3 answers 403 instead of
404 for a missing key, which reads as refused credentials). Capacity is the bucket's: a
lifecycle rule that expires objects under the prefix by age bounds it, and one that aborts
incomplete multipart uploads after a day reclaims uploads whose abort could not be sent.

Requests
--------
* botocore takes a body as ``bytes`` (or a file it reads in 8-16 KiB pieces), not as a view of
  the staging row: each value is copied once into ``bytes`` as its request starts.
* Each batch runs its requests concurrently on the backend's own threads (``REQUESTS_IN_FLIGHT``,
  also the size of the HTTP connection pool); a request only waits on its own socket.
* A value larger than ``store.s3.multipart_bytes`` is uploaded as a multipart upload in parts
  of that size (S3's rule: 5 MiB to 5 GiB per part, the last may be smaller, at most 10,000
  parts). An upload that fails at any step is aborted, and an object appears only when the
  upload is completed, so a reader never sees part of a value.
* A get asks for the first bytes of the object up to one more than a value's size (a range
  request): an object of another length (truncated, or replaced by something of any size) still
  reads as the wrong length, which the tier refuses, and a huge one is not fetched whole into
  the engine's memory.
* Retries: botocore's own retries are off (``total_max_attempts=1``): its ``standard`` and
  ``adaptive`` modes also retry refused connections and timeouts, so a server that hangs would
  cost ``max_attempts`` timeouts per request before the tier hears of it, while the tier's
  per-server backoff must take over at the first (its blocks are misses meanwhile). This module
  retries what S3 asks to be retried, throttling (``SlowDown``, HTTP 429/503) and server errors
  (HTTP 5xx), up to ``store.s3.max_attempts`` attempts per request with exponential backoff and
  full jitter (``RETRY_BASE_S`` doubling, each wait at most ``RETRY_MAX_S``: 1.5 s in all for 5
  attempts); a connection the server closed is retried once at once (a pooled keep-alive
  connection may close just as it is reused). A server still throttling or failing after the
  attempts counts as unavailable.
* Timeouts (``store.remote.timeout_s``): the connect timeout is ``timeout_s``. A read timeout
  bounds each wait for the next bytes of a reply, not a whole transfer, so a large body that
  keeps flowing never times out; but the wait before the first byte of a reply grows with the
  size of the value on a real service (it stores the whole body before answering a put, and
  fetches it before answering a get). Requests without a value (HEAD, DELETE, LIST, commit
  markers) wait ``timeout_s``; requests that carry or return a value wait ``timeout_s`` plus the
  value's size at ``ucm.store.backends.SLOW_SERVER_BYTES_PER_S`` (an 8 MiB value: +0.25 s). The default
  ``timeout_s`` of 0.2 s suits a service on the local network; against AWS S3 over a WAN, 1-2 s
  avoids counting its tail latency as an outage.
* Endpoints other than AWS are addressed path-style (``http://host/bucket/key``): every
  S3-compatible server supports it, while virtual-hosted style needs wildcard DNS. Checksums are
  sent only where S3 requires them (``DeleteObjects``): servers that predate the CRC headers
  reject them, and every value carries its own header and per-shard checksums that the reader
  verifies.

Failures: a refused or lost connection, a timeout, refused credentials (HTTP 403 of
``AccessDenied``, ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, expired tokens) or a bucket
that vanished make the tier leave the service alone for a backoff (``ucm.store.remote``). Any
other error of one request fails only its key: a put reports why, a get reads a miss (logged;
e.g. an object that a lifecycle rule moved to an archive class).
"""
from __future__ import annotations

import logging
import random
import re
import time
from typing import Optional, Sequence
from urllib.parse import urlsplit

from ucm import threads
from ucm.config import ConfigError
from ucm.store.backends import Backend, Unavailable, data_timeout
from ucm.store.base import BlockGeometry
from ucm.store.format import header_size
from ucm.store.remote import VALUE_ALIGN, RemoteStore, remote_options

log = logging.getLogger("ucm.store.s3")

REQUESTS_IN_FLIGHT = 16
#: the throughput below which a value request counts as stuck (read timeout rule above)
RETRY_BASE_S = 0.1
RETRY_MAX_S = 2.0
MAX_PARTS = 10_000
#: S3's largest part of a multipart upload, and its largest value sent in one PutObject
MAX_PART_BYTES = 5 * 1024**3
MAX_OBJECT_BYTES = 5 * 1024**4
DELETE_BATCH = 1000
#: requests without a value body or reply are at most this large
_SMALL = 64 * 1024

_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                             "RequestLimitExceeded", "RequestThrottled", "ServiceUnavailable",
                             "InternalError", "RequestTimeout"})
#: the request was refused for who sent it (or when: a skewed clock), not for its key
_AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                         "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
                         "RequestTimeTooSkewed", "403"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def _boto3():
    try:
        import boto3
    except ImportError as exc:
        raise ConfigError("config key 'store.pipeline': the s3 tier needs boto3 "
                          "(pip install boto3)") from exc
    return boto3


class _Missing(Exception):
    """The key has no object."""


class _Failed(Exception):
    """One request failed for a reason of its own key (the server itself is fine); ``code``:
    S3's error code."""

    def __init__(self, why: str, code: str = ""):
        super().__init__(why)
        self.code = code


def redacted(url: str) -> str:
    """``url`` without user and password (an endpoint URL should hold neither)."""
    try:
        parts = urlsplit(url)
        if "@" in parts.netloc:
            return parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]).geturl()
    except ValueError:
        pass
    return url


def check_endpoint(url: str) -> Optional[str]:
    """Why ``url`` is not a usable endpoint URL, or ``None``."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected http://host[:port] or https://host[:port]"
    if parts.username is not None or parts.password is not None:
        return ("credentials do not belong in the URL; they come from the AWS chain "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role)")
    if parts.query or parts.fragment:
        return "no query or fragment"
    return None


def check_bucket(name: str) -> Optional[str]:
    """Why ``name`` cannot be a bucket name, or ``None`` (the looser rules every S3-compatible
    service accepts; the service checks its own)."""
    if not name:
        return "empty: name the bucket that holds the blocks (it must exist)"
    if "/" in name or ":" in name or any(c.isspace() for c in name):
        return ("a bucket name only (no s3:// scheme, no '/': a key prefix goes in "
                "store.s3.prefix)")
    if not 3 <= len(name) <= 63:
        return "3 to 63 characters"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        return "letters, digits, '.', '-' and '_' only (what an S3 request can address)"
    return None


def check_region(name: str) -> Optional[str]:
    """Why ``name`` cannot be a region, or ``None``. botocore's own check of a region matches
    with ``$``, which also accepts a trailing newline (a value read from a file); the region
    then goes into a header that the HTTP client refuses, which would read as an unreachable
    endpoint."""
    if not re.fullmatch(r"(?![0-9]+$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)", name):
        return "a region name such as 'us-east-1' (letters, digits and '-')"
    return None


class S3Backend(Backend):
    """One bucket at one endpoint. ``part_bytes``: values larger than this are uploaded in parts
    of this size; ``value_bytes``: the size of the tier's values (it sets the read timeout of
    value requests, and a get reads at most one byte more: an object of another size is refused
    by the tier as it is, so one that was replaced by a huge object is not fetched whole)."""

    reads_into_rows = False

    def __init__(self, bucket: str, *, endpoint_url: str = "", region: str = "",
                 timeout_s: float = 0.2, part_bytes: int = 8 * 1024**2, max_attempts: int = 5,
                 value_bytes: int = 0, requests_in_flight: int = REQUESTS_IN_FLIGHT):
        boto3 = _boto3()
        from botocore.config import Config as BotoConfig

        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.name = f"s3://{bucket}@{redacted(endpoint_url) or 'aws'}"
        self.part_bytes = int(part_bytes)
        self.max_attempts = max(1, int(max_attempts))
        self.max_value_bytes = min(MAX_OBJECT_BYTES, MAX_PARTS * self.part_bytes)
        self.value_bytes = int(value_bytes)
        value_timeout = data_timeout(timeout_s, max(value_bytes, _SMALL))

        def config(read_timeout: float) -> BotoConfig:
            return BotoConfig(
                connect_timeout=timeout_s, read_timeout=read_timeout,
                retries={"total_max_attempts": 1, "mode": "standard"},
                max_pool_connections=requests_in_flight, tcp_keepalive=True,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"addressing_style": "path"} if endpoint_url else None)

        from botocore.exceptions import BotoCoreError, InvalidRegionError

        try:
            session = boto3.session.Session(region_name=region or None)
            kw = dict(endpoint_url=endpoint_url or None)
            self._meta = session.client("s3", config=config(timeout_s), **kw)
            self._data = session.client("s3", config=config(value_timeout), **kw)
        except InvalidRegionError as exc:
            raise ConfigError(f"config key 'store.s3.region': {region!r}: {exc}") from None
        except ValueError as exc:  # botocore's check of the endpoint URL
            raise ConfigError(f"config key 'store.s3.endpoint_url': {redacted(endpoint_url)!r}: "
                              f"{exc}") from None
        except BotoCoreError as exc:
            # the AWS chain is read as the clients are made: a profile that does not exist, a
            # config file that does not parse, a key id without its secret, a credential
            # process that fails. The server is not the cause, but like refused credentials
            # the tier cannot reach it until the chain is repaired.
            raise Unavailable(f"{self.name}: the AWS chain cannot be read ({exc}); credentials "
                              f"come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                              f"~/.aws or an instance role") from None
        self._pool = threads.pool(requests_in_flight, "ucm-s3-req")
        self._closed = False

    # -- one request ----------------------------------------------------------------------------
    def _request(self, fn, **kw):
        """``fn(Bucket=..., **kw)`` with the retry rules of the module docstring. Raises
        ``_Missing`` (no such key), ``_Failed`` (this key's request failed) or Unavailable."""
        from botocore import exceptions as be

        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(Bucket=self.bucket, **kw)
            except be.ClientError as exc:
                err = exc.response.get("Error", {})
                code = str(err.get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if code in _MISSING_CODES:
                    raise _Missing() from None
                if code == "NoSuchBucket":
                    raise Unavailable(f"{self.name}: bucket {self.bucket!r} does not exist "
                                      f"(config key 'store.s3.bucket')") from exc
                if code in _AUTH_CODES:
                    raise Unavailable(f"{self.name}: refused ({code} {err.get('Message', '')}): "
                                      f"the AWS chain's credentials are refused or lack a "
                                      f"permission on the bucket") from exc
                if code in _THROTTLE_CODES or status == 429 or status >= 500:
                    if attempt < self.max_attempts:
                        self._sleep(attempt)
                        continue
                    raise Unavailable(f"{self.name}: {code or status} after {attempt} "
                                      f"attempt(s)") from exc
                raise _Failed(f"{code or status}: {err.get('Message', '')}".strip(),
                              code) from exc
            except be.ConnectionClosedError as exc:
                if attempt == 1:
                    continue  # a pooled connection closed by the server: once more, fresh
                raise Unavailable(f"{self.name}: {exc}") from exc
            except (be.ConnectionError, be.HTTPClientError, be.IncompleteReadError) as exc:
                raise Unavailable(f"{self.name}: {exc}") from exc
            except (be.NoCredentialsError, be.PartialCredentialsError,
                    be.CredentialRetrievalError) as exc:
                raise Unavailable(f"{self.name}: {exc} (credentials come from the AWS chain: "
                                  f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, an instance "
                                  f"role)") from exc

    @staticmethod
    def _sleep(attempt: int) -> None:
        time.sleep(random.uniform(0, min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempt - 1))))

    def _map(self, fn, items: Sequence) -> list:
        """``fn(item)`` for every item on the request threads, results in order. After one
        request found the server unavailable, requests not yet started are skipped and the
        batch raises that Unavailable (a dead server costs one timeout, not one per key)."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        down: list = []

        def one(x):
            if down:
                raise down[0]
            try:
                return fn(x)
            except Unavailable as exc:
                down.append(exc)
                raise

        futures = [self._pool.submit(one, x) for x in items]
        out, first = [], None
        for f in futures:
            try:
                out.append(f.result())
            except Unavailable as exc:
                first = first or exc
                out.append(None)
        if first is not None:
            raise down[0] if down else first
        return out

    # -- Backend --------------------------------------------------------------------------------
    def put(self, keys, values) -> list[Optional[str]]:
        return self._map(lambda kv: self._put_one(*kv), list(zip(keys, values)))

    def _put_one(self, key: str, value) -> Optional[str]:
        client = self._data if len(value) > _SMALL else self._meta
        try:
            if len(value) > self.part_bytes:
                self._put_multipart(key, value)
            else:
                self._request(client.put_object, Key=key, Body=bytes(value))
            return None
        except (_Failed, _Missing) as exc:
            return str(exc) or "not found"

    def _put_multipart(self, key: str, value) -> None:
        if len(value) > self.max_value_bytes:
            raise _Failed(f"value of {len(value)} bytes exceeds {self.max_value_bytes} "
                          f"({MAX_PARTS} parts of store.s3.multipart_bytes)")
        upload = self._request(self._meta.create_multipart_upload, Key=key)["UploadId"]
        try:
            parts = []
            for n, start in enumerate(range(0, len(value), self.part_bytes), 1):
                r = self._request(self._data.upload_part, Key=key, UploadId=upload, PartNumber=n,
                                  Body=bytes(value[start:start + self.part_bytes]))
                parts.append({"ETag": r["ETag"], "PartNumber": n})
            self._request(self._data.complete_multipart_upload, Key=key, UploadId=upload,
                          MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self._request(self._meta.abort_multipart_upload, Key=key, UploadId=upload)
            except Exception as exc:  # the object never appears; a lifecycle rule reclaims it
                log.warning("ucm s3: multipart upload of %s not aborted (%s)", key, exc)
            raise

    def get(self, keys, rows) -> list:
        return self._map(self._get_one, list(keys))

    def _get_one(self, key: str):
        # bytes 0..value_bytes: a value whole, or one byte more when the object is longer (the
        # tier refuses it for its length without it crossing the network whole)
        rng = {"Range": f"bytes=0-{self.value_bytes}"} if self.value_bytes else {}
        try:
            body = self._request(self._data.get_object, Key=key, **rng)["Body"]
        except _Missing:
            return None
        except _Failed as exc:
            if rng and exc.code == "InvalidRange":  # no byte at 0: an empty object
                return b""
            log.warning("ucm s3: get %s failed (%s); read as a miss", key, exc)
            return None
        from botocore import exceptions as be

        try:
            with body:
                return body.read()
        except (be.ConnectionError, be.HTTPClientError, be.IncompleteReadError) as exc:
            raise Unavailable(f"{self.name}: {exc}") from exc

    def exists(self, keys) -> list[bool]:
        return self._map(self._exists_one, list(keys))

    def _exists_one(self, key: str) -> bool:
        try:
            self._request(self._meta.head_object, Key=key)
            return True
        except _Missing:
            return False
        except _Failed as exc:
            log.warning("ucm s3: head %s failed (%s); read as absent", key, exc)
            return False

    def delete(self, keys) -> None:
        keys = list(keys)
        self._map(self._delete_some, [keys[i:i + DELETE_BATCH]
                                      for i in range(0, len(keys), DELETE_BATCH)])

    def _delete_some(self, keys: list) -> None:
        try:
            r = self._request(self._meta.delete_objects,
                              Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        except (_Failed, _Missing) as exc:
            log.warning("ucm s3: delete of %d key(s) failed (%s)", len(keys), exc)
            return
        for e in r.get("Errors", ())[:3]:
            log.warning("ucm s3: delete %s failed (%s)", e.get("Key"), e.get("Code"))

    def ping(self) -> None:
        """HeadBucket. A bucket that does not exist is a ConfigError naming ``store.s3.bucket``
        (waiting for it to appear would not help); anything else that fails is Unavailable."""
        try:
            self._request(self._meta.head_bucket)
        except _Missing:
            raise ConfigError(f"config key 'store.s3.bucket': bucket {self.bucket!r} does "
                                  f"not exist at {self.endpoint_url or 'AWS'} (the tier never "
                                  f"creates buckets: create it, with a lifecycle rule under "
                                  f"the prefix)") from None
        except _Failed as exc:
            raise Unavailable(f"{self.name}: {exc}") from exc

    def keys(self, prefix: str):
        """ListObjectsV2 page by page (continuation tokens), each page under the retry rules."""
        kw = {"Prefix": prefix}
        while True:
            page = self._request(self._meta.list_objects_v2, **kw)
            for obj in page.get("Contents", ()):
                yield obj["Key"]
            if not page.get("IsTruncated"):
                return
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for c in (self._meta, self._data):
            c.close()


class S3Store(RemoteStore):
    name = "s3"

    @classmethod
    def from_config(cls, geometry: BlockGeometry, config, namespace: bytes,
                    codec: int = 0) -> "S3Store":
        bucket = config["store.s3.bucket"]
        why = check_bucket(bucket)
        if why:
            raise ConfigError(f"config key 'store.s3.bucket': {bucket!r}: {why}")
        endpoint = config["store.s3.endpoint_url"].strip()
        if endpoint:
            why = check_endpoint(endpoint)
            if why:
                raise ConfigError(f"config key 'store.s3.endpoint_url': {redacted(endpoint)!r}: "
                                  f"{why}")
        region = config["store.s3.region"]
        why = check_region(region) if region else None
        if why:
            raise ConfigError(f"config key 'store.s3.region': {region!r}: {why}; empty: the "
                              f"AWS chain's")
        part_bytes = config["store.s3.multipart_bytes"]
        if part_bytes > MAX_PART_BYTES:
            raise ConfigError(f"config key 'store.s3.multipart_bytes': {part_bytes}: at most "
                              f"{MAX_PART_BYTES} (5 GiB: S3's largest part, and its largest "
                              f"value sent in one request)")
        prefix = config["store.s3.prefix"]
        opts = remote_options(config)
        header = header_size(geometry.n_shards, VALUE_ALIGN)
        backend_opts = dict(endpoint_url=endpoint, region=region,
                            timeout_s=opts["timeout_s"],
                            part_bytes=part_bytes,
                            max_attempts=config["store.s3.max_attempts"],
                            value_bytes=header + geometry.block_bytes)
        def unreachable(exc) -> ConfigError:
            return ConfigError(f"config key 'store.s3.endpoint_url': s3 bucket {bucket!r} not "
                               f"reachable at {redacted(endpoint) or 'AWS'}: {exc}")

        # The bucket is checked before the tier exists (a missing bucket is a ConfigError naming
        # store.s3.bucket, which the tier's own check would report as an unreachable server);
        # the tier then takes over this backend.
        try:
            first = S3Backend(bucket, **backend_opts)
        except Unavailable as exc:
            raise unreachable(exc) from None
        try:
            first.ping()
            # a server that says an object no one wrote exists (a web server or proxy answering
            # 200 to everything) is not an S3 server: every lookup would be a hit, every load a
            # miss
            probe = f"{prefix}/ucm-absent-{random.getrandbits(64):016x}"
            if first.exists([probe])[0]:
                raise ConfigError(f"config key 'store.s3.endpoint_url': {redacted(endpoint)!r} "
                                  f"says {probe!r}, an object that cannot exist, is there: not "
                                  f"an S3 server")
        except Unavailable as exc:
            first.close()
            raise unreachable(exc) from None
        except BaseException:
            first.close()
            raise
        spare = [first]

        def connect(_name: str) -> S3Backend:
            return spare.pop() if spare else S3Backend(bucket, **backend_opts)

        server = f"s3://{bucket}/{prefix}@{endpoint or 'aws'}"
        store = cls(geometry, [server], connect, namespace=namespace, codec=codec, key_prefix=prefix, **opts)
        store.check_reachable("store.s3.endpoint_url")
        return store
