"""Images sent inside a request (``data:`` URLs and uploads): moved to :mod:`clova_train.tools.data_urls`, the
runtime layer, so that in-process tool clients materialise them exactly as the HTTP server does. Re-exported here
for the server (:mod:`clova_train.serving.http`, :mod:`clova_train.serving.guard`), with the rule confining the
server paths a client names to ``--image-root`` (:func:`confined_server_paths`)."""

from __future__ import annotations

from clova_train.tools.data_urls import (IMAGE_FIELDS, SENT_FORMATS, SUFFIXES, RequestTooLarge, ServerPathRefused,
                                         as_data_url, check_request_pixels, confined_server_paths, image_paths,
                                         materialised_images, parse_data_url)

__all__ = ["IMAGE_FIELDS", "SENT_FORMATS", "SUFFIXES", "RequestTooLarge", "ServerPathRefused", "as_data_url",
           "check_request_pixels", "confined_server_paths", "image_paths", "materialised_images", "parse_data_url"]
