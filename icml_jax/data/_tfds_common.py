"""Shared TFDS plumbing: prepare a builder as array_record without TensorFlow, read text back.

Verified with tensorflow-datasets 4.9.10 and no TensorFlow installed: a
``tfds.core.GeneratorBasedBuilder`` constructed with ``file_format='array_record'`` prepares through
``download_and_prepare`` (the plain Python writer; no Beam, no ``tf.io``) and reads back through
``builder.as_data_source()`` / ``tfds.data_source``. Two things are needed:

* ``DatasetInfo`` is built directly (``LocalDatasetInfo(builder=self, ...)``, a
  ``tfds.core.DatasetInfo``) instead of ``dataset_info_from_configs``, which looks for metadata
  files next to the builder's module.
* ``code_path`` is overridden (``LocalBuilder``): TFDS 4.9.10's default implementation touches
  ``importlib_resources.abc``, a backport that TFDS only declares for Python < 3.9, so preparing a
  builder defined inside a package fails with ``ModuleNotFoundError: importlib_resources`` on 3.11.
* ``DownloadConfig(try_download_gcs=False)`` so that preparing never tries to reach the TFDS GCS
  bucket (these corpora are generated locally). For the same reason ``LocalDatasetInfo`` skips
  ``DatasetInfo.initialize_from_bucket``, which a builder calls while its folder holds no metadata
  yet: TFDS 4.9.10 makes a ``tmp*tfds`` folder for the bucket's files before finding there are
  none, and leaves it behind in the system temp folder (one per first build).

Records come back as dicts of ``bytes`` for ``Text`` features (TF would decode them to ``str``), so
readers decode UTF-8 themselves (``record_text``).
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

SPLITS = ("train", "validation", "test")


class LocalBuilder:
    """Mixin for builders defined in this package (put it before GeneratorBasedBuilder)."""

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:  # pylint: disable=no-self-argument
        return epath.Path(inspect.getfile(cls))


class LocalDatasetInfo(tfds.core.DatasetInfo):
    """``DatasetInfo`` of a locally generated corpus: no metadata to fetch from the TFDS bucket."""

    def initialize_from_bucket(self) -> None:
        return None


def resolve_data_dir(data_dir: str | None) -> str | None:
    """'' / None -> None, which lets TFDS use $TFDS_DATA_DIR or ~/tensorflow_datasets."""
    return os.path.expanduser(data_dir) if data_dir else None


def prepare(builder: tfds.core.DatasetBuilder) -> tfds.core.DatasetBuilder:
    """Writes the builder's array_record files once; later calls reuse them."""
    if not builder.is_prepared():
        tfds.disable_progress_bar()
        builder.download_and_prepare(
            file_format=tfds.core.FileFormat.ARRAY_RECORD,
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder


def record_text(value: Any) -> str:
    """Decodes a Text feature value read without TF (bytes) to str."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "item"):  # numpy scalar / 0-d array of bytes
        return record_text(value.item())
    return str(value)
