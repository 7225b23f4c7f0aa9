"""Images from requests: data URLs, uploads and (when enabled) remote URLs, decoded safely.

Decoding checks the declared size from the header BEFORE decoding pixels (decompression bombs), accepts only
common still-image formats, and fully decodes (a truncated file is an error, not a grey half-image).

Remote fetching (off by default) guards against SSRF: the host must be on the allowlist; the name is resolved
and EVERY address must be public (loopback, private, link-local / metadata, multicast, reserved and
unspecified addresses are refused unless inside an explicitly trusted network); the connection then goes to
the checked address itself (Host header and TLS SNI keep the name), so a second DNS answer cannot redirect it;
redirects are followed by hand and each hop is checked the same way; bytes are capped while streaming.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import re
import socket
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from .config import ServerConfig
from .errors import APIError, bad_request

ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def decode_image(data: bytes, config: ServerConfig, where: str) -> Image.Image:
    """Bytes -> RGB PIL image, enforcing the byte, pixel and format limits."""
    if len(data) > config.max_image_bytes:
        raise APIError(413, f"{where}: image is {len(data)} bytes, the limit is {config.max_image_bytes}",
                       "image_too_large", where)
    if not data:
        raise bad_request(f"{where}: empty image", "invalid_image", where)
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            width, height = img.size
            if fmt not in ALLOWED_FORMATS:
                raise bad_request(f"{where}: unsupported image format {fmt!r} (allowed: "
                                  f"{', '.join(sorted(ALLOWED_FORMATS))})", "invalid_image", where)
            if width * height > config.max_image_pixels:
                raise APIError(400, f"{where}: image is {width}x{height} = {width * height} pixels, the limit is "
                               f"{config.max_image_pixels}", "image_too_many_pixels", where)
            img.seek(0)  # first frame of an animation
            img.load()  # decodes fully: truncated data raises here
            return img.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise bad_request(f"{where}: not a readable image ({exc})", "invalid_image", where) from exc


def decode_data_url(url: str, config: ServerConfig, where: str) -> Image.Image:
    match = _DATA_URL.match(url)
    if match is None or not match.group("b64"):
        raise bad_request(f"{where}: expected a base64 data URL (data:image/png;base64,...)", "invalid_image_url",
                          where)
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise bad_request(f"{where}: data URL media type {mime!r} is not an image", "invalid_image_url", where)
    payload = url[match.end():]
    if len(payload) > config.max_image_bytes * 4 // 3 + 4:
        raise APIError(413, f"{where}: image data URL is larger than {config.max_image_bytes} bytes",
                       "image_too_large", where)
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{where}: invalid base64 in the data URL ({exc})", "invalid_base64", where) from exc
    return decode_image(data, config, where)


# ---------------------------------------------------------------------------------------------- remote URLs
def host_allowed(host: str, patterns: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for pat in patterns:
        pat = pat.lower().rstrip(".").strip("[]")
        if pat.startswith("*."):
            if host.endswith(pat[1:]) and host != pat[2:]:
                return True
        elif host == pat:
            return True
    return False


def address_forbidden(addr: Address, config: ServerConfig) -> str | None:
    """Why ``addr`` may not be fetched from, or None when it may."""
    if isinstance(addr, ipaddress.IPv6Address):
        mapped = addr.ipv4_mapped or addr.sixtofour
        if mapped is not None:
            addr = mapped
    if any(addr in net for net in config.trusted_networks):
        return None
    for reason, flag in (("loopback", addr.is_loopback), ("link-local/metadata", addr.is_link_local),
                         ("private", addr.is_private), ("multicast", addr.is_multicast),
                         ("unspecified", addr.is_unspecified), ("reserved", addr.is_reserved),
                         ("non-global", not addr.is_global)):
        if flag:
            return reason
    return None


async def resolve(host: str, port: int) -> list[Address]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise bad_request(f"image URL host {host!r} does not resolve ({exc})", "image_fetch_failed") from exc
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


async def checked_address(url: str, config: ServerConfig, where: str) -> tuple[httpx.URL, str, Address]:
    """Validate one hop: scheme, allowlist, resolution; returns (url, host, the address to connect to)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise bad_request(f"{where}: only http(s) image URLs are allowed", "invalid_image_url", where)
    if parts.username or parts.password:
        raise bad_request(f"{where}: credentials in image URLs are not allowed", "invalid_image_url", where)
    host = (parts.hostname or "").lower()
    if not host:
        raise bad_request(f"{where}: image URL has no host", "invalid_image_url", where)
    if not host_allowed(host, config.remote_image_hosts):
        raise bad_request(f"{where}: image host {host!r} is not on the allowlist", "image_host_not_allowed", where)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = await resolve(host, port)
    for addr in addresses:
        if (reason := address_forbidden(addr, config)) is not None:
            raise bad_request(f"{where}: image host {host!r} resolves to a {reason} address ({addr}); refused",
                              "image_url_forbidden_address", where)
    if not addresses:
        raise bad_request(f"{where}: image URL host {host!r} has no address", "image_fetch_failed", where)
    return httpx.URL(url), host, addresses[0]


async def fetch_remote(url: str, config: ServerConfig, client: httpx.AsyncClient, where: str) -> bytes:
    """Download an allowlisted public image, following redirects by hand with a check per hop."""
    if not config.allow_remote_images:
        raise bad_request(f"{where}: remote image URLs are disabled on this server; send a data URL",
                          "remote_images_disabled", where)
    current = url
    for _hop in range(config.remote_image_max_redirects + 1):
        target, host, addr = await checked_address(current, config, where)
        pinned = target.copy_with(host=str(addr))
        headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*"}
        extensions: dict[str, Any] = {"sni_hostname": host} if target.scheme == "https" else {}
        try:
            async with client.stream("GET", pinned, headers=headers, extensions=extensions) as resp:
                if resp.is_redirect:
                    location = resp.headers.get("location")
                    if not location:
                        raise bad_request(f"{where}: redirect without a Location", "image_fetch_failed", where)
                    current = urljoin(current, location)
                    continue
                if resp.status_code != 200:
                    raise bad_request(f"{where}: image URL answered HTTP {resp.status_code}", "image_fetch_failed",
                                      where)
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > config.max_image_bytes:
                    raise APIError(413, f"{where}: remote image is {declared} bytes, the limit is "
                                   f"{config.max_image_bytes}", "image_too_large", where)
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > config.max_image_bytes:
                        raise APIError(413, f"{where}: remote image is larger than {config.max_image_bytes} "
                                       "bytes", "image_too_large", where)
                return bytes(body)
        except httpx.HTTPError as exc:
            raise bad_request(f"{where}: could not fetch the image ({type(exc).__name__})", "image_fetch_failed",
                              where) from exc
    raise bad_request(f"{where}: too many redirects", "image_fetch_failed", where)


async def load_image_url(url: Any, config: ServerConfig, client: httpx.AsyncClient, where: str) -> Image.Image:
    """An ``image_url`` value (data URL or http(s) URL) -> RGB image; decoding runs in a worker thread."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: image_url.url must be a non-empty string", "invalid_image_url", where)
    if url[:5].lower() == "data:":
        return await asyncio.to_thread(decode_data_url, url, config, where)
    if url.split(":", 1)[0].lower() in ("http", "https"):
        data = await fetch_remote(url, config, client, where)
        return await asyncio.to_thread(decode_image, data, config, where)
    raise bad_request(f"{where}: image_url must be a data URL (or an http(s) URL when enabled)",
                      "invalid_image_url", where)
