// The README's gateway examples from Node (@grpc/grpc-js + @grpc/proto-loader
// on the .proto files), called as outside clients call by default: with no
// deadline. Prints one JSON object per line for tests/integration/test_public_clients.py.
//
//   node readme_examples.js HOST:PORT PROTO_ROOT TEMPLATE_NAME
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, protoRoot, templateName] = process.argv.slice(2);
const definition = protoLoader.loadSync(path.join(protoRoot, "kvd_api/gateway/v1/gateway.proto"), {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});
const Gateway = grpc.loadPackageDefinition(definition).kvd.gateway.v1.Gateway;
const client = new Gateway(address, grpc.credentials.createInsecure());

const unary = (method, request) =>
  new Promise((resolve, reject) =>
    client[method](request, (err, reply) => (err ? reject(err) : resolve(reply))),
  );

function stream(request) {
  return new Promise((resolve, reject) => {
    const messages = [];
    const call = client.Generate(request);
    call.on("data", (m) => messages.push(m));
    call.on("error", reject);
    call.on("end", () => resolve(messages));
  });
}

const report = (what, value) => console.log(JSON.stringify({ what, ...value }));

async function main() {
  const template = await unary("CreateTemplate", {
    name: templateName,
    content: "You are the support assistant of ACME Corp. ACME sells anvils and rockets.",
  });
  report("CreateTemplate", { token_count: template.token_count });

  const prompt = " Customer: what do you sell? Assistant:";
  const sampling = { max_new_tokens: 8, ignore_eos: true };
  const messages = await stream({ template: templateName, text: prompt, sampling });
  const last = messages[messages.length - 1];
  report("Generate", {
    token_ids: messages.flatMap((m) => m.token_ids),
    text: messages.map((m) => m.text).join(""),
    usage: last.usage,
  });

  const whole = await unary("Complete", { template: templateName, text: prompt, sampling });
  report("Complete", { token_ids: whole.token_ids, text: whole.text, usage: whole.usage });

  const info = await unary("Info", {});
  report("Info", { model: info.model, templates: info.templates });
}

main().then(
  () => process.exit(0),
  (err) => {
    report("error", { code: err.code, details: err.details });
    process.exit(1);
  },
);
