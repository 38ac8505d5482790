// Validates Gateway API objects (gateway.networking.k8s.io/v1 Gateway and
// HTTPRoute) against the schemas published in the npm package
// @kubernetes-models/gateway-api (generated from the Gateway API's Go types):
//
//   1. its own validate(): types, enums, patterns, required fields, list sizes
//      (ajv, compiled from the OpenAPI schema);
//   2. unknown fields, which that schema does not reject (it allows additional
//      properties): every key is looked up in the package's type declarations
//      (the flattened property list of each generated class), recursively.
//
// Usage: node gateway_api_schema.mjs NODE_MODULES_DIR < docs.json
// stdin: a JSON array of objects; stdout: a JSON array of
// {"supported": bool, "errors": [string]} in the same order.
import { readFileSync, existsSync } from "node:fs";
import { join, dirname, basename } from "node:path";
import { pathToFileURL } from "node:url";

const nodeModules = process.argv[2];
const pkg = join(nodeModules, "@kubernetes-models", "gateway-api");
const KINDS = {
  "gateway.networking.k8s.io/v1": ["Gateway", "HTTPRoute"],
};

const propsCache = new Map();

// The properties of the class declared in a .d.ts file: name -> {file, array}
// where file is the .d.ts of the property's type when it is one of the
// package's own object types (null for strings, numbers, maps and types from
// other packages, such as ObjectMeta).
function classProps(file) {
  if (propsCache.has(file)) return propsCache.get(file);
  let result = null;
  if (existsSync(file)) {
    const text = readFileSync(file, "utf8");
    const imports = new Map();
    for (const m of text.matchAll(/^import \{ (\w+) \} from "(\.\/[^"]+)\.js";$/gm)) {
      imports.set(m[1], join(dirname(file), m[2] + ".d.ts"));
    }
    const body = text.match(/^export declare class \w+ extends Model<\w+>[^{]*\{\n([\s\S]*?)^\}/m);
    if (body) {
      result = new Map();
      // One property a line, at four spaces; a map type ("x"?: {) spans
      // lines and is not descended into.
      for (const m of body[1].matchAll(/^ {4}"([^"]+)"\??: (.*?);?$/gm)) {
        const arr = m[2].match(/^Array<(\w+)>$/);
        const type = arr ? arr[1] : m[2];
        result.set(m[1], { file: imports.get(type) ?? null, array: Boolean(arr) });
      }
    }
  }
  propsCache.set(file, result);
  return result;
}

function unknownFields(value, file, path, errors) {
  if (value === null || typeof value !== "object" || Array.isArray(value) || !file) return;
  const props = classProps(file);
  if (!props) return;
  for (const [key, child] of Object.entries(value)) {
    const prop = props.get(key);
    const where = `${path}/${key}`;
    if (!prop) {
      errors.push(`${where}: unknown field (${basename(file, ".d.ts")} has ${[...props.keys()].join(", ")})`);
      continue;
    }
    if (prop.array && Array.isArray(child)) {
      child.forEach((item, i) => unknownFields(item, prop.file, `${where}/${i}`, errors));
    } else {
      unknownFields(child, prop.file, where, errors);
    }
  }
}

const docs = JSON.parse(readFileSync(0, "utf8"));
const out = [];
for (const doc of docs) {
  const kinds = KINDS[doc.apiVersion] ?? [];
  if (!kinds.includes(doc.kind)) {
    out.push({ supported: false, errors: [] });
    continue;
  }
  const base = join(pkg, ...doc.apiVersion.split("/"), doc.kind);
  const errors = [];
  const mod = await import(pathToFileURL(base + ".js").href);
  try {
    new mod[doc.kind](doc).validate();
  } catch (e) {
    errors.push(...String(e.message).split(", ").map((s) => s.replace(/^data/, "")));
  }
  unknownFields(doc, base + ".d.ts", "", errors);
  out.push({ supported: true, errors });
}
process.stdout.write(JSON.stringify(out));
