"""Package metadata for koila-retry; the build system and tool settings are in pyproject.toml."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "koila_retry" / "_version.py").read_text()).group(1)

setup(
    name="koila-retry",
    version=VERSION,
    description="Make PyTorch code adapt to the memory it has: out-of-memory errors become smaller batches.",
    long_description=(HERE / "README.rst").read_text(encoding="utf-8"),
    long_description_content_type="text/x-rst",
    license="Apache-2.0",
    packages=find_packages(include=["koila_retry", "koila_retry.*"]),
    package_data={"koila_retry": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "psutil>=5.9", "cachetools>=5.3"],
    extras_require={
        "progress": ["tqdm>=4.60"],
        "plot": ["matplotlib>=3.7"],
        # For koila_retry.integrations.transformers and the examples; import koila_retry never imports it.
        # Trainer needs accelerate: 0.26 or later for transformers 4.40 (tested: 4.40.0 with 0.26.1).
        "transformers": ["transformers>=4.40", "accelerate>=0.26.1"],
        # koila_retry.integrations.lightning.OOMRecovery, and examples/trainer_lightning.py.
        "lightning": ["lightning>=2.4"],
    },
    entry_points={"console_scripts": ["koila-retry=koila_retry.__main__:main"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
