"""What target and draft workers share: the typed phase payloads and sentinels (``payloads``), their
protobuf conversion (``convert``), and the verification maths (``rejection``, ``triton_rejection``)."""
