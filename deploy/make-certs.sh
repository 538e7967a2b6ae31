#!/usr/bin/env bash
# Make a test certificate authority, a TLS certificate for the SuperLink and one SuperNode
# authentication key pair per site.  For tests and trials only: in a real federation the
# coordinating site's CA (or a public one) signs the SuperLink certificate and each hospital
# makes its own key pair and sends only the public key to the coordinator.
#
#   deploy/make-certs.sh OUT_DIR [SUPERLINK_HOST] [SITE ...]
#   deploy/make-certs.sh deploy/secrets 127.0.0.1 site-0 site-1 site-2
set -euo pipefail
out=${1:?usage: make-certs.sh OUT_DIR [SUPERLINK_HOST] [SITE ...]}
host=${2:-127.0.0.1}
shift $(( $# >= 2 ? 2 : 1 ))
sites=("$@")
mkdir -p "$out/keys"
cd "$out"

openssl req -x509 -newkey rsa:3072 -nodes -days 365 -subj "/CN=gep-fed test CA" \
  -keyout ca.key -out ca.crt 2>/dev/null
case "$host" in
  *[!0-9.]*) san="DNS:$host,DNS:localhost,IP:127.0.0.1" ;;
  *) san="IP:$host,DNS:localhost,IP:127.0.0.1" ;;
esac
openssl req -newkey rsa:3072 -nodes -subj "/CN=$host" -keyout server.key -out server.csr \
  2>/dev/null
printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" \
  "$san" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
  -extfile server.ext -out server.crt 2>/dev/null
rm -f server.csr server.ext ca.srl
chmod 600 ca.key server.key

for site in "${sites[@]}"; do
  rm -f "keys/$site" "keys/$site.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "$site" -f "keys/$site"
done
echo "made $out/ca.crt, $out/server.crt, $out/server.key and keys for: ${sites[*]:-no sites}"
