#!/usr/bin/env bash
# Makes a throwaway CA plus a server and a client certificate, for trying TLS and mutual
# TLS (docs/security.md) on one machine. Not for production: keys are unencrypted and the
# CA key sits next to them. Both certificates name localhost and 127.0.0.1 and may serve
# and authenticate (serverAuth + clientAuth), so either worker can use either.
#
#   deploy/make_test_ca.sh [OUT_DIR] [DAYS] [EXTRA_SANS]   (default: ./certs, 30 days;
#       EXTRA_SANS e.g. IP:10.0.0.2,DNS:decode.internal for hosts other than this one)
#
# Writes OUT_DIR/{ca.pem,ca.key,server.pem,server.key,client.pem,client.key}.
set -euo pipefail

out=${1:-certs}
days=${2:-30}
extra=${3:-}
command -v openssl >/dev/null || { echo "make_test_ca.sh: openssl not found" >&2; exit 1; }
mkdir -p "$out"
cd "$out"
umask 077
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -out ca.pem -days "$days" -subj "/CN=kvtransfer test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"

cat > leaf.ext <<EXT
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:localhost,IP:127.0.0.1${extra:+,$extra}
EXT
for name in server client; do
    key "$name.key"
    openssl req -new -key "$name.key" -out "$name.csr" -subj "/CN=localhost"
    openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$name.pem" \
        -days "$days" -extfile leaf.ext 2>/dev/null
    rm "$name.csr"
done
rm -f leaf.ext ca.srl
chmod 644 ca.pem server.pem client.pem
echo "test CA and certificates in $(pwd): ca.pem server.pem/.key client.pem/.key"
