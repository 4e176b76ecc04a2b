"""pytest settings shared by every test file."""


def pytest_configure(config):
  config.addinivalue_line("markers", "full_data: needs the full offline data files (../shared/data); see tests/data_paths.py")
