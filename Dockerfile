# syntax=docker/dockerfile:1
#
# The reconciler image: one static binary on a distroless base, run as a
# non-root user. Build and try it:
#
#   docker build -t reconciler:local .
#   docker run --rm reconciler:local version
#
# integration/packaging_test.go runs this file's `go build` line and checks
# the result is a static binary, that ENTRYPOINT is the file that build
# produces, and that the final stage runs as a numeric non-root user (which
# Kubernetes' runAsNonRoot can verify without reading /etc/passwd).

# The Go version follows go.mod's `go` line (the test checks it is not older).
FROM golang:1.26-bookworm AS build
WORKDIR /src
# Dependencies first: they change less often than the code, so this layer
# is reused across most rebuilds.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# CGO off: no libc, so the binary runs on a base image with nothing in it.
# The commit is not stamped (.dockerignore leaves .git out of the context):
# `reconciler version` prints "commit: unknown" for a local image build.
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/reconciler ./cmd/reconciler

# distroless/static has CA certificates (the adapters call HTTPS APIs) and
# tzdata, and no shell or package manager.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/reconciler /usr/local/bin/reconciler
# 65532 is distroless's "nonroot" user.
USER 65532:65532
# `run --metrics-addr :9090` serves /metrics, /healthz and /readyz here.
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/reconciler"]
CMD ["--help"]
