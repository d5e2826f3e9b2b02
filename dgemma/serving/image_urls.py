"""Images in chat requests: the URLs of `image_url` content parts -> the prompt's ImageInputs.

A URL is either a data URL (`data:image/png;base64,...`), read in place, or an http(s) URL, fetched only
when its host is one the operator named (`dgemma serve --allowed-image-domains`). By default nothing is
fetched: a server that fetched any address a client sent would let clients reach, through it, hosts
only the server can see. A fetch goes straight to the named host (no proxy from the environment), with
a timeout and a size cap, and follows a redirect only to another named host.

Every unusable image is a 400 that says why: not an image, truncated, more pixels than the limit (read
from the header: a decompression bomb is refused before it is decoded), too many images, a data URL
that is not base64, a host that is not allowed. Decoding and resizing run off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from dgemma.images import DEFAULT_MAX_PIXELS, ImageError, ImageInputs, ImageProcessor, expand_image_tokens, open_image
from dgemma.serving.errors import bad_request

MAX_REDIRECTS = 3
PARAM = "messages"


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_pixels: int = DEFAULT_MAX_PIXELS  # per image, from its header
    max_fetch_bytes: int = 20 << 20  # per fetched image
    fetch_timeout_s: float = 10.0
    allowed_domains: frozenset[str] = frozenset()  # hosts whose http(s) URLs are fetched (lower case)


class ImageReader:
    """What the server needs to take images for one model: its processor settings, its image token ids
    (`config`: image_token_id, boi_token_id, eoi_token_id) and the limits."""

    def __init__(self, processor: ImageProcessor, config, limits: ImageLimits = ImageLimits()):
        self.processor, self.config, self.limits = processor, config, limits

    def card(self) -> dict:
        """What /v1/models says about images."""
        return {"accepted": True, "max_per_request": self.limits.max_images,
                "max_soft_tokens": self.processor.max_soft_tokens, "max_pixels": self.limits.max_pixels,
                "remote_urls": bool(self.limits.allowed_domains)}

    async def read(self, urls: list[str]) -> ImageInputs:
        """The images of a request's URLs, in order, ready for the model; a 400 APIError for any bad one."""
        if len(urls) > self.limits.max_images:
            raise bad_request(f"{PARAM}: {len(urls)} images, and this server takes at most "
                              f"{self.limits.max_images} per request", param=PARAM, code="too_many_images")
        sources = [self._data(url) if url.startswith("data:") else self._checked_remote(url) for url in urls]
        for i, source in enumerate(sources):  # one at a time: the size cap bounds what is held
            if isinstance(source, str):
                sources[i] = await self._fetch(source)
        return await asyncio.to_thread(self._decode, sources)

    def expand(self, ids: list[int], images: ImageInputs) -> list[int]:
        """A rendered prompt (one placeholder per image) -> the prompt with room for the images' soft tokens."""
        c = self.config
        try:
            return expand_image_tokens(ids, images.num_soft_tokens, image_token_id=c.image_token_id,
                                       boi_token_id=c.boi_token_id, eoi_token_id=c.eoi_token_id)
        except ImageError as e:  # a chat template that ignores image parts, or a placeholder typed in the text
            raise bad_request(f"{PARAM}: {e} (the chat template writes one per image part; the text must not "
                              "hold one)", param=PARAM) from None

    # -- sources ------------------------------------------------------------------------------------------
    @staticmethod
    def _data(url: str) -> bytes:
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise bad_request(f"{PARAM}: an image data URL must be base64-encoded: data:image/png;base64,...",
                              param=PARAM, code="invalid_image_url")
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{PARAM}: the image data URL is not valid base64", param=PARAM,
                              code="invalid_image_url") from None

    def _checked_remote(self, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise bad_request(f"{PARAM}: an image URL must be a data URL (data:image/png;base64,...) or http(s), "
                              f"got {url[:40]!r}", param=PARAM, code="invalid_image_url")
        if (parts.hostname or "").lower() not in self.limits.allowed_domains:
            why = ("this server fetches no remote images" if not self.limits.allowed_domains
                   else f"{parts.hostname!r} is not among the hosts this server fetches images from")
            raise bad_request(f"{PARAM}: {why}; send the image as a data URL (data:image/png;base64,...)",
                              param=PARAM, code="image_url_not_allowed")
        return url

    async def _fetch(self, url: str) -> bytes:
        import httpx

        limit = self.limits.max_fetch_bytes
        try:
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                         timeout=self.limits.fetch_timeout_s) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    async with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = self._checked_remote(urljoin(url, response.headers.get("location", "")))
                            continue
                        if response.status_code != 200:
                            raise bad_request(f"{PARAM}: fetching the image at {url} answered HTTP "
                                              f"{response.status_code}", param=PARAM, code="image_fetch_failed")
                        declared = response.headers.get("content-length", "")
                        if declared.isdigit() and int(declared) > limit:
                            raise self._too_big(url, limit)
                        data = bytearray()
                        async for chunk in response.aiter_bytes():
                            data += chunk
                            if len(data) > limit:
                                raise self._too_big(url, limit)
                        return bytes(data)
        except httpx.HTTPError as e:
            raise bad_request(f"{PARAM}: could not fetch the image at {url}: {type(e).__name__}", param=PARAM,
                              code="image_fetch_failed") from None
        raise bad_request(f"{PARAM}: more than {MAX_REDIRECTS} redirects fetching the image at {url}", param=PARAM,
                          code="image_fetch_failed")

    @staticmethod
    def _too_big(url: str, limit: int):
        return bad_request(f"{PARAM}: the image at {url} is larger than {limit} bytes", param=PARAM,
                           code="image_too_large")

    def _decode(self, sources: list[bytes]) -> ImageInputs:
        parts = []
        for i, data in enumerate(sources):
            try:  # processed at once: one decoded full-size image alive at a time
                parts.append(self.processor([open_image(data, max_pixels=self.limits.max_pixels)]))
            except ImageError as e:
                raise bad_request(f"{PARAM}: image {i + 1}: {e}", param=PARAM, code="invalid_image") from None
        return ImageInputs.cat(parts)
