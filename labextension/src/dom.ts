/**
 * Small DOM helpers of the panel and the status item.
 */

import { IConnection } from './api';

export type Child = Node | string | null | undefined | false;

/** A DOM element with attributes (a `data-*`, `class`, `title`...) and children. */
export function h(
  tag: string,
  attrs: Record<string, string | undefined> = {},
  ...children: Child[]
): HTMLElement {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== undefined) {
      el.setAttribute(name, value);
    }
  }
  for (const child of children) {
    if (child) {
      el.append(child);
    }
  }
  return el;
}

/** How a connection is named: its notebook as the server's sessions know it, else label or pid. */
export function nameOf(c: Pick<IConnection, 'name' | 'pid' | 'label'>): string {
  return c.name || c.label || `pid ${c.pid}`;
}

/** A connection's name, with its pid (and command) on hover. */
export function who(c: Pick<IConnection, 'name' | 'detail' | 'pid' | 'label'>): HTMLElement {
  return h('span', { class: 'jp-Overmind-who', title: c.detail || `pid ${c.pid}` }, ...breakable(nameOf(c)));
}

/**
 * A label as text with break opportunities after "/", ".", "-", ":", "(" and "," so that a long
 * model path or call wraps between its parts, never inside a name (snake_case stays whole).
 */
export function breakable(text: string): Node[] {
  const nodes: Node[] = [];
  for (const part of text.split(/(?<=[/\-.:(,])/)) {
    if (nodes.length) {
      nodes.push(document.createElement('wbr'));
    }
    nodes.push(document.createTextNode(part));
  }
  return nodes;
}

/** Text in which `backticked` parts are code: rendered as <code>, without the backticks. */
export function prose(text: string): Node[] {
  return text
    .split('`')
    .map((part, i) => (i % 2 ? h('code', {}, part) : document.createTextNode(part)))
    .filter(node => node.textContent);
}
