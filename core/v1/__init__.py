"""Generated gRPC stubs for the `bcstack.v1` protobuf package, from proto/core/v1/.

Do not edit the `*_pb2*.py(i)` files: change the .proto and run `make proto`
(`python -m bcstack.protogen`); tests/test_proto.py fails while they are stale.
"""
